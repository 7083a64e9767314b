"""moe_export.runtime.entrypoints.server: the OpenAI- and Anthropic-compatible HTTP server (`moe-export serve`)."""
