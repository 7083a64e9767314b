"""The recipe schema's import path as users know it; the schema lives in `moe_export.common.recipe`."""

from moe_export.common.recipe import *  # noqa: F401,F403
from moe_export.common.recipe import load_recipe, resolve_recipe_path  # noqa: F401
