"""Fine-tuning what aiayn loads: a loaded starting point (``source``), your own data, LoRA adapters."""
