"""moe_export.plugins"""
