"""Where every stage's output lives, relative to the project directory: the paths dvc.yaml lists as deps and
outs. The one place a stage's directory is named."""

from pathlib import Path

CORPUS = Path("data/corpus")
TOKENIZER = Path("data/tokenizer")
PACKED = Path("data/packed")
PRETRAIN = Path("data/pretrain")
CHAT = Path("data/chat")
SFT = Path("data/sft")
DPO_REFERENCE = Path("data/dpo_reference")
DPO = Path("data/dpo")
GRPO = Path("data/grpo")
EVALUATE = Path("data/evaluate")
REGISTER = Path("data/register")

MODELS = {"pretrain": PRETRAIN, "sft": SFT, "dpo": DPO, "grpo": GRPO}  # the training stages, in chain order
MODEL_STAGES = tuple(MODELS)  # each one's model starts the next enabled one


def model_dir(root: Path, stage: str) -> Path:
    return root / MODELS[stage]
