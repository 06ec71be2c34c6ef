"""What the evaluate stage scores with: the held-out metrics (metrics; light, params reads them), its pictures
(plots), and lm-evaluation-harness's tasks (lm_eval_data writes their items, lm_eval_adapter runs them)."""
