"""Test double of Triton's `triton_python_backend_utils` (the module the Python-backend stub provides),
written from the Python backend's documented API (README "Usage", "Decoupled mode", "Request
Cancellation Handling", "Error Handling"), not from its code. Documented behaviours reproduced:

- `Tensor(name, numpy_array)`, `.name()`, `.as_numpy()`; string tensors are numpy object arrays of bytes.
- `get_input_tensor_by_name(request, name)` returns None for an optional input the client did not send.
- `request.get_response_sender()`, `request.request_id()`, `request.requested_output_names()` (empty when
  the client asked for no specific output), `request.is_cancelled()`.
- `InferenceResponse(output_tensors=[...], error=None)`; `TritonError(message, code)` with the documented
  codes (UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED).
- Decoupled mode: `sender.send(response=None, flags=0)` may be called from any thread, after `execute`
  returned; `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` closes the sender, and a send after that raises
  TritonModelException; a response of None is only valid together with the final flag; `execute` must
  return None; `sender.is_cancelled()` turns true once the client cancels the request.
- Output tensors must be declared in the model config; `using_decoupled_model_transaction_policy(config)`.
"""

from __future__ import annotations

import threading

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(name, str) or not isinstance(array, np.ndarray):
            raise TritonModelException("Tensor(name: str, array: numpy.ndarray)")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """Collects what the model sends; `done` is set by the final flag."""

    def __init__(self, request: InferenceRequest, declared_outputs: set[str]) -> None:
        self.request = request
        self.declared_outputs = declared_outputs
        self.responses: list[InferenceResponse] = []
        self.flags: list[int] = []
        self.done = threading.Event()
        self.lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self.lock:
            if self.done.is_set():
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                raise TritonModelException("a None response is only valid with the final flag")
            if response is not None:
                for tensor in response.output_tensors():
                    if tensor.name() not in self.declared_outputs:
                        raise TritonModelException(f"output {tensor.name()} is not declared in the model config")
                self.responses.append(response)
            self.flags.append(flags)
            if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self.done.set()

    def is_cancelled(self) -> bool:
        return self.request.is_cancelled()


class InferenceRequest:
    """What Triton hands to `execute` (built by the test as a client would send it)."""

    def __init__(self, inputs: list[Tensor], request_id: str = "", requested_output_names: list[str] | None = None,
                 declared_outputs: set[str] = frozenset()) -> None:
        self._inputs = {t.name(): t for t in inputs}
        self._request_id = request_id
        self._requested = list(requested_output_names or [])
        self._cancelled = threading.Event()
        self.sender = ResponseSender(self, set(declared_outputs))

    def inputs(self) -> list[Tensor]:
        return list(self._inputs.values())

    def request_id(self) -> str:
        return self._request_id

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client side of cancellation (gRPC stream cancel)."""
        self._cancelled.set()


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request._inputs.get(name)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
