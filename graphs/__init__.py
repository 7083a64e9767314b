"""moe_export.graphs"""
