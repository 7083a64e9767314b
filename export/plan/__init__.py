"""What a recipe needs before any weight is read: parameters, per-rank memory (`planner`), what a GPU really offers
and what runs beside the engine (`memory`), each backend's terms in that count (`backend_terms`), and the decode
step's traffic and dp cost models (`traffic`, `decode_model`)."""
