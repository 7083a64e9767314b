"""moe_export.quantize"""
