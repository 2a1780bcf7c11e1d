import os
import sys

# the example programs double as end-to-end test programs
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
