"""moe_export.export"""
