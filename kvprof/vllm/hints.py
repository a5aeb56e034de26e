"""The API server's check of client hints: a request with a malformed hint gets an HTTP 400 naming the field.

vLLM checks every request's ``SamplingParams`` before it reaches the engine, and runs there the
``validate_params`` of each custom logits processor (``--logits-processors``): a ``ValueError``
becomes a ``VLLMValidationError``, which the OpenAI server answers with a 400. That is vLLM's hook
for a plugin's per-request arguments, so the plugin adds :class:`HintCheck` to the model's logits
processors when kvprof is configured (:func:`kvprof.vllm.plugin.add_hint_check`). Its ``apply``
changes no logit and it says so (``is_argmax_invariant``), so vLLM's sampler calls it only for
batches that sample, where it returns the logits untouched.
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor

from kvprof.models.hints import hint_of_args

#: How the plugin names the check among the model's logits processors.
HINT_CHECK = f"{__name__}:HintCheck"


class HintCheck(LogitsProcessor):
    """Refuses a request whose ``extra_args`` (``vllm_xargs``) carry a malformed hint; changes no logit."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raises ValueError (a 400) naming the hint field that cannot take its value."""
        hint_of_args(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
