"""Kimi chat formats, one module per family (`k3`, `k2`), checkpoint Jinja templates (`template`), what they
share (`common`) and the output parser (`parsing`); the special-token table they use is
`moe_export.graphs.tokens`. The public API is `moe_export.runtime.chat`."""
