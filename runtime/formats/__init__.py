"""Kimi chat formats, one module per family (`k3`, `k2`), checkpoint Jinja templates (`template`), the
special-token table (`markers`), what they share (`common`) and the output parser (`parsing`). The public API
is `moe_export.runtime.chat`."""
