"""moe_export.runtime"""
