# expect-framework: llamafactory
# expect-findings: token-budget
import sys
from odb.integrations.llamafactory import run_exp

run_exp(sys.argv[1:], buffer_size=2048)
