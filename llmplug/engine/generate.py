"""``model.generate`` on llmplug: HF prepares the inputs, llmplug runs the decoding loop on paged KV.

The override calls ``GenerationMixin.generate(..., custom_generate=_decode_loop)``, so generation configs,
special tokens, logits processors, stopping criteria, streamers and ``num_return_sequences`` are HF's own.
Whatever the loop does not support goes to stock HF generate with a one-time warning naming the option.
"""

from __future__ import annotations

import functools
import warnings

import torch
from transformers import (
    EosTokenCriteria,
    GenerationMixin,
    MaxLengthCriteria,
    MinPLogitsWarper,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..state import current_state, require_state
from .generate_spec import aux_layers_of, draft_tokens, prepare_draft, speculate
from .hf_cache import CACHE_FIELD, fill_hf_cache
from .late_stops import LateStops, host_criteria
from .runner import MAX_EOS, ModelRunner
from .sequences import SequenceBatch

_SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# generate() kwargs the loop understands; any other model kwarg (pixel_values, token_type_ids, ...) falls back.
_KNOWN_KWARGS = {"input_ids", "attention_mask", "use_cache", "tokenizer", "logits_to_keep"}
_warned: set[str] = set()


def _merged_config(model, generation_config, kwargs: dict):
    """The GenerationConfig HF will use: ``generation_config`` or the model's, updated by matching ``kwargs``."""
    overrides = {k: v for k, v in kwargs.items() if hasattr(model.generation_config, k)}
    return model._prepare_generation_config(generation_config, **overrides)[0]


def _move_stop_strings(config, kwargs: dict) -> None:
    """Turn ``stop_strings`` into a ``StopStringCriteria`` in ``kwargs['stopping_criteria']``.

    HF does not hand the tokenizer to a custom decoding loop, so its own stop-string criterion cannot be built.
    """
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer=... to generate")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
    kwargs.update(stopping_criteria=criteria, stop_strings=None)


def _fallback_reason(model, config, kwargs: dict) -> str | None:
    """Why this call must run on stock HF generate, or None (the reasons known before HF prepares the inputs)."""
    for name in ("past_key_values", "cache", "inputs_embeds", "custom_generate", "synced_gpus",
                 "negative_prompt_ids", "position_ids", "cache_position"):
        if kwargs.get(name) is not None:
            return name
    extra = sorted(k for k in kwargs if k not in _KNOWN_KWARGS and not hasattr(model.generation_config, k)
                   and k not in ("inputs", "generation_config", "logits_processor", "stopping_criteria", "streamer",
                                 "prefix_allowed_tokens_fn", "assistant_model"))
    if extra:
        return ", ".join(extra)
    mode = config.get_generation_mode(None)
    if mode is GenerationMode.ASSISTED_GENERATION:  # prompt lookup: speculation over greedy or sampling
        mode = GenerationMode.SAMPLE if config.do_sample else GenerationMode.GREEDY_SEARCH
    if mode not in _SUPPORTED_MODES:
        return f"{mode.value} (num_beams={config.num_beams})" if config.num_beams > 1 else mode.value
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(config, flag, False):
            return flag
    if config.cache_implementation not in (None, "dynamic"):  # stock builds that cache (and compiles a static one)
        return f"cache_implementation={config.cache_implementation!r}"
    if getattr(config, "guidance_scale", None) not in (None, 1.0):
        return "guidance_scale"
    runner = require_state(model).runner
    kind = runner.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) != runner.dtype:
        return f"torch.autocast(dtype={torch.get_autocast_dtype(kind)}) over a {runner.dtype} model"
    return None


def _loop_fallback_reason(attention_mask: torch.Tensor | None, max_length: int,
                          runner: ModelRunner) -> tuple[str, str] | None:
    """``(kind, reason)`` when the prepared call must run HF's own loop (inputs llmplug would answer differently
    from stock), else None. ``attention_mask: (B, L)`` as HF prepared it (None when nothing is padded)."""
    if attention_mask is not None:
        real = attention_mask.bool()
        if not real.any(dim=1).all():
            return "empty row", "a row whose attention_mask is all zeros"
        if not real[:, -1].all():  # stock predicts from the last position, a pad token there
            return "right padding", "right-padded inputs (stock HF predicts from the pad position; pad on the left)"
    if max_length > runner.max_model_len:
        return "length", (f"max_length={max_length} beyond max_model_len={runner.max_model_len} "
                          f"({runner.max_model_len_source}; raise it with llmplug.optimize(model, max_model_len=...))")
    return None


def _speculation(generation_config, assistant, possible: bool, runner: ModelRunner) -> int | None:
    """Draft tokens a verify step may take for this call (None: no speculation). Speculation runs for greedy decoding
    and for sampling with stateless warpers (temperature, top-k/p, min-p), without a streamer, scores or a returned
    cache; other calls decode without it (the same tokens, or the same distribution), with a one-time warning."""
    k = draft_tokens(generation_config, assistant)
    if k is None:
        return None
    k = min(k, runner.max_model_len - generation_config.max_length)
    if not possible or k < 1:
        _warn_once("speculation", "llmplug speculates only for greedy decoding or sampling with temperature / top-k / "
                   "top-p / min-p, without other logits processors, scores, a streamer or a returned cache; this call "
                   "decodes without speculation (same tokens or distribution)")
        return None
    return k


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _fallback_warning(reason: str) -> str:
    return f"llmplug does not support {reason} yet; running stock transformers generate"


# logits warpers that ignore input_ids and the step (so a CUDA graph can bake them in)
_GRAPH_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def _processors_key(processors) -> tuple:
    """What a sampling graph bakes in: each warper's class and settings."""
    return tuple((type(p).__name__, repr(sorted(vars(p).items()))) for p in processors)


def _rewind_rng(before: torch.Tensor, ran: int, kept: int, device) -> None:
    """Leave the CUDA generator where HF's loop would: after ``kept`` sampling steps, not the ``ran`` the graph loop
    replayed (it learns late that every row finished). Its state is a seed and a Philox offset (two 64-bit words),
    which each replay advanced by the same amount."""
    if ran == kept:
        return
    start = before.view(torch.int64)[1]
    after = torch.cuda.get_rng_state(device)
    offset = after.view(torch.int64)
    offset[1] = start + (offset[1] - start) // ran * kept
    torch.cuda.set_rng_state(after, device)


def _graph_stopping(stopping_criteria, max_length: int) -> tuple[torch.Tensor, int] | None:
    """``(eos ids, length limit)`` for the graph loop (the device stops rows on eos ids; every other criterion runs on
    the host a ring of steps late, :class:`~llmplug.engine.late_stops.LateStops`), or None where there are more eos
    ids than the device checks."""
    eos, limit = [], max_length
    for c in stopping_criteria:
        if isinstance(c, MaxLengthCriteria):
            limit = min(limit, c.max_length)
        elif isinstance(c, EosTokenCriteria):
            eos.append(c.eos_token_id.reshape(-1))
    ids = torch.cat(eos) if eos else torch.empty(0, dtype=torch.long)
    return (ids, limit) if ids.numel() <= MAX_EOS else None


def llmplug_generate(model, inputs=None, generation_config=None, **kwargs):
    """HF ``generate`` with llmplug's decoding loop; same signature and return types."""
    state = require_state(model)
    if current_state(model) is not state:  # optimized again where the model moved: its new generate takes the call
        return model.generate(inputs=inputs, generation_config=generation_config, **kwargs)
    if kwargs.get("cache_implementation") == "paged":  # stock generate hands it to model.generate_batch: llmplug's
        return type(model).generate(model, inputs=inputs, generation_config=generation_config, **kwargs)
    if inputs is not None:
        kwargs["inputs"] = inputs
    config = _merged_config(model, generation_config, kwargs)
    reason = _fallback_reason(model, config, kwargs)
    if reason is not None:
        _warn_once(reason, _fallback_warning(reason))
        return type(model).generate(model, generation_config=generation_config, **kwargs)
    if config.compile_config is not None:  # stock skips it too, with a warning
        _warn_once("compile_config", "compile_config has no effect without cache_implementation='static' (stock "
                   "transformers skips compilation too); llmplug decodes with its own CUDA graphs")
    if config.stop_strings is not None:
        _move_stop_strings(config, kwargs)
    # HF hands a custom loop only the arguments its signature adds to ``_sample``'s, so the streamer and the draft
    # model are bound here (HF itself still puts the prompt into the streamer) and ``tokenizer`` (for stop strings) is
    # a parameter of the loop.
    assistant = kwargs.pop("assistant_model", None)
    if assistant is not None:
        prepare_draft(assistant, model)
    loop = functools.partial(_decode_loop, stream_to=kwargs.get("streamer"), assistant=assistant)
    if state.runner.tp is not None:  # every rank samples what rank 0 samples
        state.runner.tp.sync_rng(state.runner.device)
    with state.step_lock:  # no engine step runs on this model's runner meanwhile
        return GenerationMixin.generate(model, generation_config=generation_config, custom_generate=loop, **kwargs)


@torch.inference_mode()
def _decode_loop(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                 stream_to=None, assistant=None, tokenizer=None, **model_kwargs):
    """Mirror of HF's ``_sample`` loop over llmplug's paged runner. ``input_ids: (B, L)`` prepared by HF."""
    streamer = stream_to
    state = require_state(model)
    runner = state.runner
    prompt_mask = model_kwargs.get("attention_mask")
    fallback = _loop_fallback_reason(prompt_mask, generation_config.max_length, runner)
    if fallback is not None:  # HF prepared everything (cache included): its own loop takes over
        _warn_once(fallback[0], _fallback_warning(fallback[1]))
        return GenerationMixin._sample(model, input_ids, logits_processor=logits_processor,
                                       stopping_criteria=stopping_criteria, generation_config=generation_config,
                                       synced_gpus=False, streamer=streamer, **model_kwargs)
    pad = generation_config._pad_token_tensor
    want_dict = generation_config.return_dict_in_generate
    scores = () if want_dict and generation_config.output_scores else None
    raw_logits = () if want_dict and generation_config.output_logits else None
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    batch = input_ids.shape[0]
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)

    plain_greedy = (not generation_config.do_sample and len(logits_processor) == 0 and scores is None
                    and raw_logits is None)
    # greedy or stateless sampling: every later step is one graph replay, the stops run late on the host
    graph_sampling = (generation_config.do_sample and scores is None and raw_logits is None
                      and all(type(p) in _GRAPH_WARPERS for p in logits_processor))
    spec_k = _speculation(generation_config, assistant, (plain_greedy or graph_sampling) and streamer is None and not (
        want_dict and model_kwargs.get(CACHE_FIELD) is not None), runner)
    aux_layers = aux_layers_of(assistant) if spec_k else ()  # an EAGLE-3 head reads every position's layer inputs
    seqs = SequenceBatch(runner, input_ids, prompt_mask, generation_config.max_length + (spec_k or 0),
                         prefix_cache=not aux_layers)
    # On CUDA without a streamer the host learns that every row finished one step late (HF's DeferredStopCheck
    # idea): it queues step n+1 before it waits for step n, so the GPU never idles on the host's bookkeeping.
    deferred = input_ids.device.type == "cuda" and streamer is None
    done_host = torch.zeros((), dtype=torch.bool, pin_memory=True) if deferred else None
    done_event = None
    on_device = (_graph_stopping(stopping_criteria, generation_config.max_length)
                 if (plain_greedy or graph_sampling) and deferred else None)
    prompt_width = input_ids.shape[1]
    try:
        if aux_layers:
            runner.capture_aux(aux_layers)
        logits = seqs.prefill()
        while True:
            if plain_greedy:  # argmax of the bf16/fp16 logits equals argmax of their exact fp32 copies
                next_tokens = torch.argmax(logits, dim=-1)
            else:
                next_logits = logits.to(copy=True, dtype=torch.float32)
                next_scores = logits_processor(input_ids, next_logits)
                if scores is not None:
                    scores += (next_scores,)
                if raw_logits is not None:
                    raw_logits += (next_logits,)
                if generation_config.do_sample:
                    next_tokens = torch.multinomial(torch.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(next_scores, dim=-1)
            if has_eos:  # HF's next * unfinished + pad * (1 - unfinished), in one kernel
                next_tokens = torch.where(unfinished, next_tokens, pad)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            if done_event is not None:
                done_event.synchronize()
                if done_host.item():  # every row had finished a step ago: drop this step's extra token
                    input_ids = input_ids[:, :-1]
                    scores = scores[:-1] if scores is not None else None
                    raw_logits = raw_logits[:-1] if raw_logits is not None else None
                    break
            if input_ids.shape[1] >= generation_config.max_length:
                break
            if spec_k:  # every later token comes from verify steps
                if unfinished.any():
                    new, state.spec_stats = speculate(seqs, spec_k, assistant, generation_config, input_ids,
                                                      unfinished, stopping_criteria, pad, has_eos,
                                                      input_ids[:, :prompt_width], prompt_mask,
                                                      logits_processor if graph_sampling else None)
                    input_ids = torch.cat([input_ids, new.to(input_ids.device)], dim=-1)
                break
            if not deferred:
                if not unfinished.any():
                    break
            else:
                done_host.copy_(~unfinished.any(), non_blocking=True)
                done_event = torch.cuda.Event()
                done_event.record()
            if on_device is not None:
                eos, limit = on_device
                on_device = None
                if not unfinished.any():
                    break
                graph = runner.greedy_graph(batch) if plain_greedy else runner.sample_graph(
                    batch, logits_processor, _processors_key(logits_processor))
                if graph is not None:
                    rng = torch.cuda.get_rng_state(input_ids.device)
                    stops = LateStops(host_criteria(stopping_criteria), input_ids, unfinished, eos,
                                      int(pad) if pad is not None else 0, has_eos, limit)
                    ran = seqs.decode_in_graph(graph, next_tokens, eos, limit - input_ids.shape[1], stops)
                    new = stops.new_tokens().to(input_ids.device) if stops.tokens else input_ids[:, :0]
                    input_ids = torch.cat([input_ids, new], dim=-1)
                    if not plain_greedy:
                        _rewind_rng(rng, ran, new.shape[1], input_ids.device)
                    break
            logits = seqs.decode(next_tokens)
        cache = model_kwargs.get(CACHE_FIELD)
        if want_dict and cache is not None:  # the KV stock would hand back: every token but the last
            fill_hf_cache(cache, runner, seqs, prompt_mask, prompt_width, input_ids.shape[1] - 1)
    finally:
        if aux_layers:
            runner.capture_aux(None)
        seqs.release()
    if streamer is not None:
        streamer.end()
    if want_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits,
                                         **{CACHE_FIELD: cache})
    return input_ids
