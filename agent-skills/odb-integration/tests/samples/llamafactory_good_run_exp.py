# expect-framework: llamafactory
# expect-findings:
"""torchrun --nproc_per_node=8 llamafactory_good_run_exp.py qwen_sft.yaml: llamafactory-cli train, with odb."""
from odb.integrations.llamafactory import run_exp

if __name__ == "__main__":
    run_exp(token_budget=16384, buffer_size=2048)
