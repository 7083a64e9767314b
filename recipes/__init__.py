"""moe_export.recipes: shipped YAML recipes, model configs, and the recipe schema."""

from pathlib import Path


def recipes_dir() -> Path:
    """Folder holding the shipped `*.yaml` recipes."""
    return Path(__file__).resolve().parent


def models_dir() -> Path:
    """Folder holding the shipped HF-style model configs (`models/*.json`)."""
    return recipes_dir() / "models"
