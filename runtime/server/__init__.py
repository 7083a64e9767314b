"""moe_export.runtime.server: the OpenAI- and Anthropic-compatible HTTP server (`moe-export serve`)."""
