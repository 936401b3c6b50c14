"""crispedit: non-destructive knowledge editing of LLMs with low-curvature projected fine-tuning."""

__version__ = "0.1.0"
