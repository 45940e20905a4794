"""Forward passes over padded batches with a KV cache, shared by generation and the update.

Prompts are left-padded (``left_pad``) so that their last tokens line up and a cache built
over them can be continued by every row at once; continuations are right-padded
(``right_pad``). Position ids always count the real tokens only, so a padded row sees the
same positions as it would alone.

``response_logprobs`` is the update's forward pass. Like generation, it computes a prompt
once for all its samples: the distinct prompts run once, with gradients, and every row
continues its prompt's KV cache with its response only. Rows run in chunks of similar
response length (``length_chunks``), so that a batch of short and long responses is not
padded to its longest. Against one forward pass per row, a group of n samples costs one
prompt instead of n; the log-probabilities are the same.

Under gradient checkpointing (a model in training mode with
``gradient_checkpointing_enable()``) layers are recomputed in the backward pass, which a KV
cache filled in the forward pass cannot survive (transformers then drops the cache), so
``response_logprobs`` runs each row whole, prompt + response, in one padded pass
(``_whole_rows``): more tokens, far less activation memory.

``backward_logprobs`` is the update's forward and backward: the same passes, but each
model call is followed by its own backward (a chunk's right after its forward, on leaves cut
from the prompt pass's KV and last logits; the prompt pass's last, with the gradients those
leaves gathered). A micro-batch is then the sequence of model calls F (F B)^c B, c the
chunks with more than one response token (``chunk_passes``): FSDP2 ranks, whose collectives
run in those calls, agree on it and pad with ``zero_loss`` passes (``ops/algo/parallel.py``).

Every log-probability here, as in generation, is that of the behaviour policy:
``policy_logprobs`` of the temperature-scaled logits, renormalised over the top-p nucleus
when ``top_p < 1`` (the convention of both engines: the HF decode loop and vLLM's
``processed_logprobs``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

# log of float32's smallest normal: the trainer's log-probability of a token outside its own
# nucleus (possible once the weights moved); exp of a difference of two values in
# [LOGPROB_FLOOR, 0] is at most about 1 / tiny (8.5e37), finite in float32.
LOGPROB_FLOOR = math.log(torch.finfo(torch.float32).tiny)  # -87.34


def nucleus_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] True where a token is outside the top-p nucleus of ``softmax(scaled)``.

    vLLM's rule (``apply_top_k_top_p_pytorch``), computed as it does: sort ascending, cumulate
    the probabilities, drop a token while the cumulative sum up to and including it is
    <= 1 - top_p (``top_p`` in float32, as vLLM holds it); the most likely token is always
    kept. So a token is dropped when the tokens above it already hold >= top_p of the mass,
    and the boundary token, the one whose own mass brings the nucleus to top_p, is kept.
    No gradient: the mask is a constant of the logits."""
    with torch.no_grad():
        ascending, order = scaled.sort(dim=-1)
        cum = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - torch.tensor(top_p, dtype=torch.float32).item()
        drop[..., -1] = False
        return torch.zeros_like(drop).scatter_(-1, order, drop)


def policy_logprobs(logits: torch.Tensor, temperature: float,
                    top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [..., V] log-probabilities of the behaviour policy: the
    temperature-scaled softmax, and with ``top_p < 1`` its nucleus (``nucleus_mask``) alone,
    renormalised: tokens outside get -inf. Gradients flow through the kept logits; at
    ``top_p = 1`` this is ``log_softmax(logits / temperature)`` exactly."""
    scaled = logits / temperature
    if top_p < 1:
        scaled = scaled.masked_fill(nucleus_mask(scaled.detach(), top_p), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                   top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits, [...] tokens -> [...] ``policy_logprobs`` of the tokens. With
    ``top_p < 1`` a token outside the nucleus gets ``LOGPROB_FLOOR``, not -inf, so that the
    update's ratio and KL stay finite (the ratio then clips) and its gradient is 0."""
    logp = policy_logprobs(logits, temperature, top_p).gather(-1, tokens[..., None])
    logp = logp.squeeze(-1)
    return logp if top_p >= 1 else logp.clamp(min=LOGPROB_FLOOR)


def forward_with_cache(model, cache: DynamicCache, **inputs):
    """``model(**inputs)`` appending to ``cache``; transformers >= 5.24 names the argument
    ``cache``, earlier releases ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(**inputs, use_cache=True, **{name: cache})


def layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys [B, H, T, D], values) of every layer of ``cache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            span = slice(width - len(r), width) if left else slice(0, len(r))
            ids[i, span] = torch.tensor(r)
            mask[i, span] = 1
    return ids, mask


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, W] ids with the rows right-aligned, and their [N, W] attention mask."""
    return _pad(rows, pad, left=True)


def right_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, W] ids with the rows left-aligned, and their [N, W] attention mask."""
    return _pad(rows, pad, left=False)


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded [N, W] mask (padding gets 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class _PromptPass:
    """The distinct prompts, run once: their KV per layer, the logits of their last token
    and their left-padded mask."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [U, H, P, D] keys, values
    last_logits: torch.Tensor  # [U, V]
    mask: torch.Tensor  # [U, P]

    def continue_with(self, model, owner: torch.Tensor, responses: list[list[int]],
                      pad_id: int, temperature: float, top_p: float = 1.0) -> torch.Tensor:
        """[b, r] log-probabilities of ``responses``, row i continuing prompt ``owner[i]``."""
        ids, mask = (t.to(owner.device) for t in right_pad(responses, pad_id))
        # index_select, not t[owner]: on CPU with several threads the backward of indexing
        # (an accumulating index_put_) sums in no fixed order; index_select's repeats exactly
        logits = self.last_logits.index_select(0, owner)[:, None]  # [b, 1, V]: first tokens
        width = ids.shape[1]
        if width > 1:  # the other tokens, on a cache of their prompts
            cache = DynamicCache(ddp_cache_data=[(k.index_select(0, owner),
                                                  v.index_select(0, owner)) for k, v in self.kv],
                                 config=model.config)
            starts = self.mask.sum(-1, keepdim=True)[owner]  # [b, 1]
            out = forward_with_cache(
                model, cache, input_ids=ids[:, :-1],
                attention_mask=torch.cat([self.mask[owner], mask[:, :-1]], dim=-1),
                position_ids=starts + torch.arange(width - 1, device=owner.device))
            logits = torch.cat([logits, out.logits], dim=1)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
        return token_logprobs(logits, ids, temperature, top_p)

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.kv for t in pair] + [self.last_logits]

    def detached(self) -> _PromptPass:
        """The same pass on leaves that gather the gradients of what continues it."""
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in self.tensors()]
        kv = [(leaves[2 * i], leaves[2 * i + 1]) for i in range(len(self.kv))]
        return _PromptPass(kv, leaves[-1], self.mask)

    def backward_from(self, leaves: _PromptPass) -> None:
        """The prompt pass's backward, with the gradients ``leaves`` gathered."""
        pairs = [(t, leaf.grad) for t, leaf in zip(self.tensors(), leaves.tensors())
                 if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def length_chunks(lengths: list[int], slack: float = 0.25) -> list[range]:
    """Consecutive runs of the ascending ``lengths`` whose padded tokens (rows × longest)
    stay within ``1 + slack`` times their real tokens; a run closes when the next length
    would break that."""
    chunks: list[range] = []
    start = total = 0
    for j, n in enumerate(lengths):
        if j > start and (j - start + 1) * n > (1 + slack) * (total + n):
            chunks.append(range(start, j))
            start, total = j, 0
        total += n
    if lengths:
        chunks.append(range(start, len(lengths)))
    return chunks


def _check_rows(prompts: list[list[int]], responses: list[list[int]]) -> None:
    if not all(prompts) or not all(responses):
        raise ValueError("response_logprobs: every row needs a non-empty prompt and response")


def _shared_prompts(model, prompts: list[list[int]], pad_id: int
                    ) -> tuple[_PromptPass, torch.Tensor]:
    """The pass over the distinct prompts, and for each row its prompt's index there."""
    device = next(model.parameters()).device
    index: dict[tuple[int, ...], int] = {}
    owner = torch.tensor([index.setdefault(tuple(p), len(index)) for p in prompts],
                         device=device)
    p_ids, p_mask = (t.to(device) for t in left_pad([list(p) for p in index], pad_id))
    cache = DynamicCache(config=model.config)
    out = forward_with_cache(model, cache, input_ids=p_ids, attention_mask=p_mask,
                             position_ids=positions_of(p_mask))
    return _PromptPass(layer_tensors(cache), out.logits[:, -1], p_mask), owner


def _row_chunks(responses: list[list[int]]) -> list[list[int]]:
    """Row indices per length chunk, rows by ascending response length."""
    order = sorted(range(len(responses)), key=lambda i: len(responses[i]))
    return [[order[j] for j in chunk]
            for chunk in length_chunks([len(responses[i]) for i in order])]


def _runs_whole(model) -> bool:
    return model.training and checkpointing(model)


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]],
                      pad_id: int, temperature: float,
                      top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] log-probability of each response token given its prompt and the response
    tokens before it (``token_logprobs``: temperature-scaled, over the top-p nucleus,
    float32 or wider), and the [B, R] mask of real tokens, responses left-aligned; see the
    module docstring."""
    _check_rows(prompts, responses)
    if _runs_whole(model):
        return _whole_rows(model, prompts, responses, pad_id, temperature, top_p)
    prompt, owner = _shared_prompts(model, prompts, pad_id)
    device = owner.device
    width = max(map(len, responses))
    chunks = _row_chunks(responses)
    parts = [torch.nn.functional.pad(
        prompt.continue_with(model, owner[rows], [responses[i] for i in rows], pad_id,
                             temperature, top_p),
        (0, width - max(len(responses[i]) for i in rows)))
        for rows in chunks]
    restore = torch.argsort(torch.tensor([i for rows in chunks for i in rows], device=device))
    return torch.cat(parts)[restore], _scored([len(r) for r in responses], width, device)


def _scored(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] mask of the real tokens of left-aligned rows of ``lengths``."""
    return torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]


ChunkLoss = Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_passes(model, responses: list[list[int]]) -> int:
    """How many model calls ``backward_logprobs`` makes after the prompt pass (c of the
    module docstring): chunks whose longest response has more than one token; 0 when rows
    run whole."""
    if _runs_whole(model):
        return 0
    return sum(max(len(responses[i]) for i in rows) > 1 for rows in _row_chunks(responses))


def zero_loss(model, pad_id: int) -> torch.Tensor:
    """A one-token forward pass's loss that is exactly 0 and reaches every parameter: its
    backward adds zeros to every gradient, and runs every collective a pass runs."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device))
    return out.logits.float().sum() * 0.0


def backward_logprobs(model, prompts: list[list[int]], responses: list[list[int]],
                      pad_id: int, temperature: float, chunk_loss: ChunkLoss,
                      pad_passes: int = 0, top_p: float = 1.0) -> None:
    """Accumulate the gradients of sum over chunks of ``chunk_loss(rows, logp, scored)``
    (``rows``: indices into the batch; ``logp``, ``scored``: their [b, r] log-probabilities
    and real-token mask, as ``response_logprobs`` gives them), one backward per model call
    (module docstring), with ``pad_passes`` ``zero_loss`` passes before the prompt pass's
    backward. The gradients equal those of one backward, up to float32 rounding."""
    _check_rows(prompts, responses)
    if _runs_whole(model):
        logp, scored = _whole_rows(model, prompts, responses, pad_id, temperature, top_p)
        loss = chunk_loss(list(range(len(responses))), logp, scored)
        for _ in range(pad_passes):
            zero_loss(model, pad_id).backward()
        loss.backward()
        return
    prompt, owner = _shared_prompts(model, prompts, pad_id)
    leaves = prompt.detached()
    for rows in _row_chunks(responses):
        logp = leaves.continue_with(model, owner[rows], [responses[i] for i in rows], pad_id,
                                    temperature, top_p)
        lengths = [len(responses[i]) for i in rows]
        chunk_loss(rows, logp, _scored(lengths, max(lengths), owner.device)).backward()
    for _ in range(pad_passes):
        zero_loss(model, pad_id).backward()
    prompt.backward_from(leaves)


def enable_checkpointing(model) -> None:
    """Checkpoint every layer (non-reentrant); transformers >= 5.24 calls it activation
    checkpointing, earlier releases gradient checkpointing."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})


def checkpointing(model) -> bool:
    """Whether ``enable_checkpointing`` is on for ``model``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _whole_rows(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                temperature: float, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_logprobs`` without a KV cache: every row's prompt + response right-padded
    in one forward pass."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in right_pad([p + r for p, r in zip(prompts, responses)],
                                                 pad_id))
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask),
                   use_cache=False).logits
    width = max(map(len, responses))
    scored = _scored([len(r) for r in responses], width, device)  # [B, R]
    starts = torch.tensor([len(p) for p in prompts], device=device)[:, None]
    at = (starts + torch.arange(width, device=device)).clamp(max=ids.shape[1] - 1)  # [B, R]
    token = ids.gather(1, at)
    logits = logits.gather(1, (at - 1)[..., None].expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    out = token_logprobs(logits, token, temperature, top_p)
    return out.masked_fill(~scored, 0.0), scored
