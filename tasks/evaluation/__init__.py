"""What the evaluate stage scores with: the held-out metrics (metrics; light, params reads them), what the models are
scored on (held_out), each metric's interval (intervals), whether free text loops (free_text), the checks of each
stage against its start (checks), its report (report: evaluation.md), the final model's samples and each model's
answers (samples: samples.md), its pictures (plots), and lm-evaluation-harness's tasks (lm_eval_data writes their
items, lm_eval_adapter runs them)."""
