"""``generate``'s speculative path: prompt lookup (``prompt_lookup_num_tokens``), a draft model (``assistant_model``,
an HF causal LM), an EAGLE-3 head (``assistant_model=llmplug.load_eagle3(path, model)``) or any proposer object
(``assistant_model=`` an object with ``propose`` and ``release``; one with ``aux_layers`` and ``observe`` also sees
the target's inputs of those layers), for any batch size, greedy or sampling (exact rejection sampling). Stock HF
raises for assisted generation above batch 1."""

from __future__ import annotations

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria

from ..spec.adaptive import RIDGE_TOKENS, AdaptiveK
from ..spec.decode import speculative_decode
from ..spec.draft import check_draft_model
from ..spec.proposers import DraftModelProposer, NgramProposer
from ..spec.stats import SpecStats
from ..state import ensure_state
from .late_stops import LateStops, host_criteria
from .runner import MAX_GRAPH_QUERY
from .sequences import SequenceBatch


def _is_proposer(obj) -> bool:
    return callable(getattr(obj, "propose", None)) and callable(getattr(obj, "release", None))


def draft_tokens(generation_config, assistant) -> int | None:
    """The most draft tokens a step may verify, or None when the call asks for no speculation."""
    if generation_config.prompt_lookup_num_tokens is not None:
        k = int(generation_config.prompt_lookup_num_tokens)
    elif assistant is not None:
        k = int(generation_config.num_assistant_tokens)
    else:
        return None
    if k < 1:
        raise ValueError(f"speculation needs at least one draft token a step, got {k}")
    return min(k, MAX_GRAPH_QUERY - 1)


def prepare_draft(assistant, target) -> None:
    """Check that ``assistant`` can draft for ``target`` (same vocabulary) and put it on llmplug; a proposer object
    (``propose(rows, histories, k)`` and ``release()``, as :mod:`llmplug.spec.proposers`) is taken as it is."""
    if _is_proposer(assistant):
        return
    if not hasattr(assistant, "generate") or not hasattr(assistant, "config"):
        raise TypeError(f"assistant_model must be an HF causal LM or a proposer with propose(rows, histories, k), got "
                        f"{type(assistant).__name__}")
    check_draft_model(assistant, target, "assistant_model")
    ensure_state(assistant)


def aux_layers_of(assistant) -> tuple[int, ...]:
    """The target layers whose inputs ``assistant`` observes (an EAGLE-3 head's), or ``()``."""
    return tuple(getattr(assistant, "aux_layers", None) or ()) if _is_proposer(assistant) else ()


def speculate(seqs: SequenceBatch, k: int, assistant, generation_config, input_ids: torch.Tensor,
              unfinished: torch.Tensor, stopping_criteria, pad, has_eos: bool, prompt_ids: torch.Tensor,
              prompt_mask: torch.Tensor | None, processors=None) -> tuple[torch.Tensor, SpecStats]:
    """Decode ``seqs`` speculatively after their first token -> ``(new tokens (B, n) host, stats)``.

    Args:
        seqs: the call's rows, prefilled, pages sized for ``max_length + k``; for a proposer with ``aux_layers``,
            prefilled without the prefix cache while the runner captured them.
        k: most drafts a step.
        assistant: the draft model, or None for prompt lookup.
        input_ids: ``(B, L + 1)`` prompts and the first token; unfinished: ``(B,)`` after it.
        prompt_ids, prompt_mask: the prompts as HF prepared them (for the draft model's own rows).
        processors: for sampling, HF's stateless logits warpers (temperature, top-k/p, min-p); None for greedy.
    """
    eos = [c.eos_token_id.reshape(-1) for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
    eos = torch.cat(eos).cpu() if eos else torch.empty(0, dtype=torch.long)
    limit = min([generation_config.max_length] + [c.max_length for c in stopping_criteria
                                                  if isinstance(c, MaxLengthCriteria)])
    stops = LateStops(host_criteria(stopping_criteria), input_ids, unfinished, eos,
                      int(pad) if pad is not None else 0, has_eos, limit)
    histories = [seq.tokens + [t] for seq, t in zip(seqs.seqs, input_ids[:, -1].tolist())]
    if assistant is None:
        proposer = NgramProposer(max_ngram=generation_config.max_matching_ngram_size or 2)
    elif _is_proposer(assistant):
        proposer = assistant
    else:
        draft = SequenceBatch(ensure_state(assistant).runner, prompt_ids, prompt_mask, generation_config.max_length + k,
                              prefix_cache=False)
        proposer = DraftModelProposer(draft)
    if aux_layers_of(proposer):
        proposer.observe(list(range(len(seqs))), seqs.prefill_aux())
    tp = seqs.runner.tp
    policy = AdaptiveK(k, RIDGE_TOKENS.get(seqs.device.type, 4.0), agree=tp.agree if tp is not None else None)
    try:
        stats = speculative_decode(seqs, proposer, policy, histories, stops, limit - input_ids.shape[1],
                                   set(eos.tolist()), None if processors is None else _sampler(processors))
    finally:
        proposer.release()
    new = stops.new_tokens() if stops.tokens else input_ids.new_zeros((input_ids.shape[0], 0)).cpu()
    return new, stats


def _sampler(processors):
    """HF's ``_sample`` distribution: the warpers on fp32 logits, then softmax (``logits (N, V) -> probs (N, V)``).
    The warpers ignore ``input_ids`` (the caller checked), so they apply to every verified position alike."""
    def probs(logits: torch.Tensor) -> torch.Tensor:
        scores = processors(logits.new_zeros((logits.shape[0], 0), dtype=torch.long), logits.float())
        return torch.softmax(scores, dim=-1)
    return probs
