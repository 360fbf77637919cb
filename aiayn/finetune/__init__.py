"""Fine-tuning what aiayn loads: a loaded model as a run's starting point (``source``), your own
data, and LoRA adapters."""
