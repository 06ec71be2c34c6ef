"""The model registry beside the stages: a model reference resolved to a checkpoint (models), a model's card
(model_card), the MLflow pyfunc model the register stage logs (pyfunc_model), the champion gate the register stage
and `astrai promote` both decide by (gate), the registry lock they both run under (lock), `astrai promote` (promote)."""
