"""The MLflow pyfunc wrapper of a checkpoint (logged "from code" by the register stage).

    model = mlflow.pyfunc.load_model("models:/astrai@champion")
    model.predict(["ROMEO.\n"], params={"max_new_tokens": 40, "temperature": 0.0})

The weights stay in safetensors (the checkpoint directory is a model artifact); nothing is pickled.
Input: a list of prompts, or a DataFrame with a `prompt` column. Output: the generated continuations.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import torch


class AstraiLanguageModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from astrai_core.checkpoint.model_dir import load_model

        self.model, self.tokenizer, _ = load_model(context.artifacts["checkpoint"])

    # Type hints: MLflow validates the input against them (and infers the signature) instead of warning.
    def predict(self, context, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        from astrai_core.inference.generate import generate_text

        params = params or {}
        if hasattr(model_input, "columns"):  # MLflow turns a list input into a one-column DataFrame
            column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = list(model_input[column])
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = list(model_input)
        top_k = int(params.get("top_k", 0)) or None
        gen = torch.Generator().manual_seed(int(params.get("seed", 0)))
        return [
            generate_text(self.model, self.tokenizer, str(p), max_new_tokens=int(params.get("max_new_tokens", 64)),
                          temperature=float(params.get("temperature", 0.0)), top_k=top_k, generator=gen)
            for p in prompts
        ]


mlflow.models.set_model(AstraiLanguageModel())
