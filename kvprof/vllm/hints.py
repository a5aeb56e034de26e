"""The API server's check of client hints: a request with a malformed hint gets an HTTP 400 naming the field.

vLLM checks every request's ``SamplingParams`` before it reaches the engine, and runs there the
``validate_params`` of each custom logits processor (``--logits-processors``): a ``ValueError``
becomes a ``VLLMValidationError``, which the OpenAI server answers with a 400. That is vLLM's hook
for a plugin's per-request arguments, so the plugin adds :class:`HintCheck` to the model's logits
processors when kvprof is configured (:func:`kvprof.vllm.plugin.add_hint_check`): :class:`HintCheck`
for vLLM's V1 model runner, :class:`HintCheckV2` for its V2 one (another interface, where vLLM has it).
Neither changes a logit, and each says so (V1: ``is_argmax_invariant``, so the sampler calls it only for
batches that sample; V2: ``add_request`` declines every request).
"""

from __future__ import annotations

import logging

from vllm.v1.sample.logits_processor import LogitsProcessor

from kvprof.models.hints import hint_of_args, lookalike_field

try:  # vLLM's V2 model runner's interface (absent before it)
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor
except ImportError:
    V2LogitsProcessor = None

#: How the plugin names the check among the model's logits processors (V1, V2 model runner).
HINT_CHECK = f"{__name__}:HintCheck"
HINT_CHECK_V2 = f"{__name__}:HintCheckV2" if V2LogitsProcessor is not None else None


class HintRefused(ValueError):
    """A request's hint refused by :func:`refuse_malformed_hint` (vLLM answers it with a 400)."""


def refuse_malformed_hint(sampling_params) -> None:
    """Raises ValueError (a 400) naming the hint field of the request's ``extra_args`` that cannot take its value,
    or an argument that looks like a misspelt hint field (``retian_s``, ``Retain_S``, ``hint_foo``): taken as a
    tag, its hint would be lost without a word."""
    args = getattr(sampling_params, "extra_args", None)
    for name in args or ():
        meant = lookalike_field(name) if isinstance(name, str) else None
        if meant is not None:
            raise HintRefused(f"'{name}' is not a hint field; did you mean {meant if meant.startswith('a hint') else repr(meant)}? "
                             f"(a tag of another name is fine; one this close to a hint field is refused, so that a "
                             f"misspelt hint is not lost)")
    try:
        hint_of_args(args)
    except ValueError as exc:
        raise HintRefused(str(exc)) from None


class QuietHintRefusals(logging.Filter):
    """One warning line, not a traceback, for a refused hint of a streamed request.

    vLLM answers a request refused by its per-request check with a 400, but a streamed one only once
    its stream has begun (HTTP 200, an error event in the stream) and logs that with the whole
    traceback (``Error in completion stream generator``), as for any of its own refusals in a stream.
    A client's malformed hint is no server error: the record keeps its message, as a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        cause = getattr(error, "__cause__", None)
        if isinstance(cause, HintRefused):
            record.msg, record.args = "kvprof: a streamed request's hint was refused (its stream ends with a 400 " \
                                      "error event): %s", (str(cause),)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def quiet_hint_refusals() -> None:
    """Add :class:`QuietHintRefusals` to the handlers of vLLM's logger (once)."""
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, QuietHintRefusals) for f in handler.filters):
            handler.addFilter(QuietHintRefusals())


class HintCheck(LogitsProcessor):
    """Refuses a request whose ``extra_args`` (``vllm_xargs``) carry a malformed hint; changes no logit."""

    validate_params = staticmethod(refuse_malformed_hint)

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass


if V2LogitsProcessor is not None:

    class HintCheckV2(V2LogitsProcessor):
        """:class:`HintCheck` for vLLM's V2 model runner: it declines every request, so changes no logit."""

        validate_params = staticmethod(refuse_malformed_hint)

        def add_request(self, req_idx: int, sampling_params) -> bool:
            return False

        def apply(self, logits, ctx):
            return logits
