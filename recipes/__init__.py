"""moe_export.recipes: shipped YAML recipes, model configs, and the recipe schema."""

from pathlib import Path

from moe_export.common.recipe import shipped_dir


def recipes_dir() -> Path:
    """Folder holding the shipped `*.yaml` recipes."""
    return shipped_dir()


def models_dir() -> Path:
    """Folder holding the shipped HF-style model configs (`models/*.json`)."""
    return shipped_dir("models")
