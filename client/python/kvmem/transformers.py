"""kvmem.transformers: a Hugging Face transformers Cache whose K/V lives in kvmemd.

    model = AutoModelForCausalLM.from_pretrained(...)
    with kvmem.Client("unix:/run/kvmem.sock") as client, \\
            KvmemCache(model, client, kvmem.PolicySpec("confkv")) as cache:
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
        print(cache.memory())

Each row of the batch is one kvmemd sequence under the chosen policy. A forward pass goes:
- **Begin** (a forward pre-hook on the model's decoder): every row's retained K/V is read
  from kvmemd (the pool mapped read-only under the epoch protocol on the same host, ReadKv
  otherwise), per layer, padded to the longest stream (policies may keep different slots in
  different streams).
- **Each layer** (`update`): returns the retained K/V followed by the new tokens', and keeps
  the new ones for the commit. Attention runs in the "kvmem" attention function (registered
  in transformers' AttentionInterface; the model is switched to it): it masks each stream's
  padding and, when the policy reads them, keeps the signals (the last query's attention
  row, the prompt's window scores, GQA-group means over retained slots then new tokens, as
  the C++ reference worker computes them).
- **Commit** (a forward hook on the decoder): the first pass of a row creates its sequence
  (with the prompt's ids for prefix sharing), appends the prompt and compresses it under the
  policy; every later pass is one StepBatch for the whole batch: each row's new tokens and
  the step's signals (logit statistics of the last token's next-token distribution, from the
  model's output embeddings, per-token entropy and layer distance where the policy reads
  them). Nothing reaches kvmemd before the pass has finished: a pass that raises (or is
  interrupted) leaves the daemon as it was.

Only the signals the policy declares (GetInfo) are computed. Padding tokens (a 2D
attention mask, left or right) are never appended; positions are the model's position ids.
A row whose commit fails leaves the cache unusable (FailedPreconditionError from then on):
that row's sequence no longer matches what the model was shown.

The prompt is the first pass: a prompt fed in several passes (chunked prefill) is compressed
after its first chunk only, and its later chunks are steps (the C++ worker does not chunk a
prompt that a policy compresses either). An F16 layout stores what a bf16 or f32 model
computes in half precision (values past 65504 become infinities): use F32 or BF16 for such
models. A cache dropped without close() removes its hooks and unmaps the pool when it is
collected, but its sequences stay in kvmemd until their leases lapse (close it, or use it
as a context manager).

Not supported (refused at construction where the config says so): sliding-window
attention, soft-capped attention or logits, attention sinks, assisted decoding (`crop`),
torch.compile of the cache.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvmem.client import BatchEntry, Client
from kvmem.errors import FailedPreconditionError, InvalidArgumentError, KvmemError, StaleEpochError
from kvmem.layout import DType, Layout, PolicySpec, Precision
from kvmem.messages import LogitStats, NewTokens, Prompt, StepArgs, StreamSignal
from kvmem.sequence import Sequence
from kvmem.shared_pool import PaddedKv, SharedPool

_log = logging.getLogger("kvmem")

# The keyword a model pass and generate take the cache by: `past_key_values` up to
# transformers 5.2, `cache` in later lines (model(..., **{CACHE_ARGUMENT: cache})).
CACHE_ARGUMENT = "past_key_values" if transformers.__version__.startswith(
    ("4.", "5.0.", "5.1.", "5.2.")) else "cache"

ATTENTION = "kvmem"
_TOPK_ENTROPY = 256  # the token-entropy signal's top-k (the C++ worker's)
_STALE_RETRIES = 3

_current = threading.local()  # .forward: the _Forward this thread's model pass is in


def kvmem_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    dropout: float = 0.0, scaling: Optional[float] = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The "kvmem" attention function: a KvmemCache's pass attends here (masks and signals);
    anything else (another cache, no cache) gets transformers' SDPA attention unchanged."""
    forward: Optional[_Forward] = getattr(_current, "forward", None)
    layer = getattr(module, "layer_idx", None)
    if forward is None or layer is None or layer not in forward.keys:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if forward.keys.pop(layer) is not key:
        # The model changed the keys between the cache's update and its attention: the
        # padding this function masks is no longer where it was put.
        raise FailedPreconditionError(
            f"KvmemCache: layer {layer}'s keys changed between the cache's update and "
            "attention; this model's attention is not supported")
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux")
                   if kwargs.get(k) is not None]
    if unsupported:
        raise FailedPreconditionError(
            f"KvmemCache: the model's attention uses {unsupported}, which kvmem's attention "
            "does not apply")
    return forward.attend(layer, query, key, value, scaling), None


def register() -> None:
    """Registers the "kvmem" attention function (idempotent); KvmemCache calls it."""
    AttentionInterface.register(ATTENTION, kvmem_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # what the fallback expects


@dataclasses.dataclass(frozen=True)
class PrefixSharing:
    """Prompt ids sent at creation: the longest published prefix with the same model name,
    layout and salt is mapped in instead of appended; auto_publish publishes this one's."""
    cache_salt: str = ""
    model: Optional[str] = None  # None: the model's config._name_or_path
    auto_publish: bool = True


@dataclasses.dataclass(frozen=True)
class Memory:
    """What the cache's sequences hold in kvmemd against what a full cache of the same tokens
    would (layout dtype, every token of every stream)."""
    kv_bytes: int
    full_bytes: int
    tokens: int

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.kv_bytes / self.full_bytes if self.full_bytes else 0.0


def _check_supported(config: Any) -> None:
    """What kvmem_attention does not apply: sliding-window layers, soft-capping."""
    sliding = getattr(config, "sliding_window", None) and \
        getattr(config, "use_sliding_window", True)
    sliding = sliding or "sliding_attention" in (getattr(config, "layer_types", None) or ())
    capped = [k for k in ("attn_logit_softcapping", "final_logit_softcapping")
              if getattr(config, k, None)]
    if sliding or capped:
        what = "sliding-window attention" if sliding else ", ".join(capped)
        raise InvalidArgumentError(f"model: KvmemCache does not support {what} yet")


def _prefill_window(policy: PolicySpec, observation_window: int) -> int:
    """The prompt's window-score window: h2o every query, refreekv_h2o its `window`
    parameter (8), others the SnapKV observation window (Session::PrefillWindow)."""
    name = policy.name or "full"
    if name == "h2o":
        return 1 << 30
    if name == "refreekv_h2o":
        return int(policy.params.get("window", 8))
    return observation_window


def _compresses(policy: PolicySpec) -> bool:
    return (policy.name or "full") != "full" or policy.quantization is not Precision.LAYOUT


def _logit_summary(logits: torch.Tensor) -> tuple[float, float, float, float]:
    """(entropy, p1, p2, top-256 renormalized entropy) of one row of logits, in f64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    entropy = float(-(p * logp).nan_to_num().sum())
    top = torch.topk(p, min(_TOPK_ENTROPY, p.numel())).values
    q = top / top.sum()
    topk_entropy = float(-(q * q.log()).nan_to_num().sum())
    return entropy, float(top[0]), float(top[1]) if top.numel() > 1 else 0.0, topk_entropy


def _to_layout(x: torch.Tensor, dtype: DType) -> np.ndarray:
    if dtype is DType.F32:
        return x.detach().to(torch.float32).contiguous().cpu().numpy()
    if dtype is DType.F16:
        return x.detach().to(torch.float16).contiguous().cpu().numpy()
    bits = x.detach().to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy()
    return bits.view(np.uint16)


def _from_layout(a: np.ndarray, dtype: DType) -> torch.Tensor:
    if dtype is DType.BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class _Forward:
    """One model pass through a KvmemCache: the past read at its start, the new K/V each
    layer hands over, and the signals its attention leaves."""

    def __init__(self, real: torch.Tensor, positions: torch.Tensor,
                 token_ids: Optional[torch.Tensor]) -> None:
        self.real = real            # [B][q] bool: tokens that are not padding
        self.positions = positions  # [B][q] int64
        self.token_ids = token_ids  # [B][q] or None
        self.past_k: dict[int, torch.Tensor] = {}  # layer -> [B][H][P][D] (model dtype)
        self.past_v: dict[int, torch.Tensor] = {}
        self.past_valid: Optional[torch.Tensor] = None  # [L][B][H][P] bool
        self.past_slots = 0  # P
        self.counts = np.zeros((0, 0), dtype=np.int64)  # [B][streams]
        self.epochs: list[int] = []
        self.new_k: dict[int, torch.Tensor] = {}
        self.new_v: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}  # what update returned: attention checks it
        self.rows: dict[int, torch.Tensor] = {}     # layer -> [B][H][P + q] f32
        self.windows: dict[int, torch.Tensor] = {}  # layer -> [B][H][P + q] f32
        self.want_rows = False
        self.window = 0  # > 0: the prompt's window scores over the last `window` real queries
        q = real.shape[1]
        self.all_real = bool(real.all())
        # Each row's last real query (the attention row's), and the queries among its last
        # `window` real ones (the window scores'): the same for every layer of the pass.
        self.last_real = torch.tensor([int(torch.nonzero(r)[-1]) if bool(r.any()) else q - 1
                                       for r in real])
        self.in_window = torch.zeros(0)
        self.mid: Optional[torch.Tensor] = None   # hidden states after layer L/2 (distance)
        self.last: Optional[torch.Tensor] = None  # after the last layer, before the norm

    def mask(self, layer: int, B: int, H: int, q: int, P: int,
             device: torch.device) -> Optional[torch.Tensor]:
        """[B][H][q][P + q] bool: a stream's retained slots (not its padding), then the new
        real tokens causally (a padding query sees itself, so no row is empty). None when
        every key is visible to the one query (one token over unpadded streams)."""
        past_valid = self.past_valid[layer] if P > 0 and self.past_valid is not None else None
        padded = past_valid is not None and not bool(past_valid.all())
        if q == 1 and not padded and self.all_real:
            return None
        real = self.real.to(device)
        new = torch.ones(q, q, dtype=torch.bool, device=device).tril()[None] & real[:, None, :]
        new |= torch.eye(q, dtype=torch.bool, device=device)[None]  # [B][q][q]
        new = new[:, None].expand(B, H, q, q)
        if P == 0:
            return new
        if past_valid is None:
            past = torch.ones(B, H, q, P, dtype=torch.bool, device=device)
        else:
            past = past_valid.to(device)[:, :, None, :].expand(B, H, q, P)
        return torch.cat([past, new], dim=-1)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: Optional[float]) -> torch.Tensor:
        B, Hq, q, D = query.shape
        H, K = key.shape[1], key.shape[2]
        group = Hq // H
        scale = scaling if scaling is not None else D ** -0.5
        mask = self.mask(layer, B, H, q, K - q, query.device)
        if not self.want_rows and self.window == 0:
            # SDPA with grouped heads: K and V are never copied per query head.
            full = None if mask is None else mask.repeat_interleave(group, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=full, scale=scale, enable_gqa=True)
            return out.transpose(1, 2).contiguous()
        # Explicit weights (the signals need them), a GQA group's queries side by side:
        # query head h * group + g reads kv head h.
        grouped_q = query.reshape(B, H, group * q, D).float()
        scores = torch.matmul(grouped_q, key.float().transpose(2, 3)).view(B, H, group, q, K)
        scores = scores * scale
        if mask is not None:
            scores.masked_fill_(~mask[:, :, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = torch.matmul(weights.view(B, H, group * q, K).to(value.dtype), value)
        out = out.view(B, Hq, q, D)
        grouped = weights.mean(dim=2)  # [B][H][q][K]: the GQA-group mean
        if self.want_rows:
            last = self.last_real.to(query.device)
            self.rows[layer] = grouped[torch.arange(B), :, last, :].detach()
        if self.window > 0:
            inside = self.in_window.to(query.device)
            self.windows[layer] = (grouped * inside[:, None, :, None]).sum(dim=2).detach()
        return out.transpose(1, 2).contiguous()


class KvmemCache(Cache):
    """A transformers Cache whose K/V is kept by kvmemd under `policy` (module docstring).

    model: the causal LM it serves (hooks are put on its decoder, and its attention is
    switched to "kvmem", which is SDPA for every other cache, until its last KvmemCache is
    closed or collected). client: a kvmem.Client.
    dtype: the layout's element type (F32 keeps a float32 model's K/V bit for bit).
    read_path: "shared" (the pool mapped read-only; the default when the daemon exports
    one) or "grpc" (ReadKv). prefix: send prompt ids for prefix sharing. lease: seconds
    (None: the daemon's), renewed in the background while the cache is open.
    observation_window: the prompt's SnapKV window (policies other than h2o/refreekv_h2o).
    keep_reads: keep each row's last read of the pool between passes, so that a pass copies
    only the rows added since while the epoch stands (SharedPool.read_all's `since`). The
    copy is about what a DynamicCache of the retained tokens holds (plus a quarter to grow
    in); False frees it after each pass and reads every sequence whole.
    """

    def __init__(self, model: torch.nn.Module, client: Client,
                 policy: PolicySpec = PolicySpec(), *, dtype: DType = DType.F32,
                 read_path: Optional[str] = None, prefix: Optional[PrefixSharing] = None,
                 lease: Optional[float] = None, block_tokens: Optional[int] = None,
                 observation_window: int = 32, keep_reads: bool = True) -> None:
        super().__init__(layers=[])
        config = model.config.get_text_config()
        _check_supported(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.layout = Layout(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                             dtype, block_tokens, config.vocab_size)
        self.policy = policy
        self.client = client
        info = client.get_info()
        try:
            p = info.policy(policy.name or "full")
        except KeyError as e:
            raise InvalidArgumentError(f"policy: {e.args[0]}") from None
        self._step_signals = set(p.step_signals)
        self._append_signals = set(p.append_signals)
        if read_path not in (None, "shared", "grpc"):
            raise ValueError(f"read_path: {read_path!r} is neither 'shared' nor 'grpc'")
        self._pool: Optional[SharedPool] = None
        if read_path == "shared" or (read_path is None and info.shm_bytes):
            try:
                self._pool = client.attach_shared_pool()
            except FailedPreconditionError:
                if read_path == "shared":
                    raise
                # Another host's daemon, or a CPU without ordered loads (shared_pool's
                # docstring): ReadKv.
        read_path = "shared" if self._pool is not None else "grpc"
        self.read_path = read_path
        if prefix is not None and prefix.model is None:
            name = getattr(config, "_name_or_path", "") or getattr(model.config,
                                                                  "_name_or_path", "")
            if not name:
                raise InvalidArgumentError(
                    "prefix.model: the model has no name (config._name_or_path); name it, or "
                    "sequences of different models with this layout would share blocks")
            prefix = dataclasses.replace(prefix, model=name)
        self._prefix = prefix
        self._lease = lease
        self._window = _prefill_window(policy, observation_window)
        self._max_message_bytes = info.max_message_bytes
        self._model = weakref.ref(model)
        self._sequences: list[Sequence] = []
        self._seen = 0  # columns (tokens, padding included) the model has been shown
        self._batch = 0
        self._last_topk: list[float] = []  # per row: the last pass's top-k entropy
        self._reads: list[Optional[PaddedKv]] = []  # per row: its last read of the pool
        self._keep_reads = keep_reads
        self._broken: Optional[str] = None
        self._closed = False
        self._forward: Optional[_Forward] = None
        self.evicted_tokens = 0
        self.steps = 0
        register()
        _switch(model)
        self._hooks = self._install_hooks(model)
        # Also when the cache is dropped unclosed: the model keeps no hook of a dead cache,
        # and gets its attention back when its last cache goes.
        self._unhook = weakref.finalize(self, _remove, self._hooks, self._pool, self._model)

    # ---- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Releases every sequence and removes the hooks (idempotent)."""
        self._unhook()
        self._closed = True
        if self._forward is not None and getattr(_current, "forward", None) is self._forward:
            _current.forward = None
        self._forward = None
        sequences, self._sequences, self._reads = self._sequences, [], []
        errors = []
        for seq in sequences:
            try:
                seq.release()
            except KvmemError as e:
                errors.append(e)
        self._pool = None  # closed by _unhook
        self._broken = self._broken or "closed"
        if errors:
            raise errors[0]

    def __enter__(self) -> KvmemCache:
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: object) -> None:
        try:
            self.close()
        except KvmemError as e:
            if exc is None:
                raise
            # The block's own exception (a KeyboardInterrupt, say) matters more; the leases
            # lapse where a release did not get through.
            _log.warning("kvmem: closing a KvmemCache while unwinding failed: %s", e)

    @property
    def sequences(self) -> list[Sequence]:
        """One per batch row, once the first pass committed."""
        return list(self._sequences)

    def memory(self) -> Memory:
        """kvmemd's own count of what the sequences hold (Stats), against a full cache."""
        ids = {s.id for s in self._sequences}
        held = [s for s in self.client.stats(include_sequences=True).sequences
                if s.sequence_id in ids]
        per_token = 2 * self.layout.streams * self.layout.head_dim * self.layout.dtype.itemsize
        return Memory(sum(s.kv_bytes for s in held),
                      sum(s.appended_tokens for s in held) * per_token,
                      sum(s.appended_tokens for s in held))

    # ---- the transformers Cache interface ----------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        f = self._forward
        if f is None or getattr(_current, "forward", None) is not f:
            raise FailedPreconditionError(
                "KvmemCache: updated outside a pass of the model it was made for (its decoder's "
                "hooks did not run): pass the cache to that model's forward or generate")
        f.new_k[layer_idx] = key_states
        f.new_v[layer_idx] = value_states
        if layer_idx in f.past_k:
            keys, values = f.past_k[layer_idx], f.past_v[layer_idx]  # [B][H][P + q][D]
            P = f.past_slots
            if keys.dtype == key_states.dtype and keys.device == key_states.device:
                keys[:, :, P:] = key_states  # the room read_all left
                values[:, :, P:] = value_states
            else:
                keys = torch.cat([keys[:, :, :P].to(key_states.device, key_states.dtype),
                                  key_states], dim=2)
                values = torch.cat([values[:, :, :P].to(value_states.device,
                                                         value_states.dtype), value_states],
                                   dim=2)
        else:
            keys, values = key_states, value_states
        f.keys[layer_idx] = keys
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query: Union[int, torch.Tensor], layer_idx: int) -> tuple[int, int]:
        # The mask transformers builds is only the fallback's (kvmem_attention masks its own).
        # transformers 5.2 passes the cache positions, later lines the query length.
        return self._seen + (query if isinstance(query, int) else int(query.shape[0])), 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.layout.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.layout.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self._sequences)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.layout.num_layers

    @property
    def max_batch_size(self) -> int:
        return self._batch

    @property
    def max_cache_len(self) -> int:
        return -1

    def __len__(self) -> int:
        return self.layout.num_layers

    def reset(self) -> None:
        """Releases the sequences: the next pass starts a new prompt."""
        if self._closed:
            raise FailedPreconditionError("KvmemCache: closed")
        try:
            for seq in self._sequences:
                seq.release()
        except BaseException as e:
            self._broken = f"a reset failed: {e}"
            raise
        self._sequences, self._reads = [], []
        self._seen, self._batch, self._last_topk, self._broken = 0, 0, [], None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rearrange([b for b in range(self._batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rearrange([int(i) for i in indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rearrange([int(i) for i in beam_idx])

    def crop(self, length: int) -> None:
        raise NotImplementedError(
            "KvmemCache.crop: dropping the newest tokens (assisted decoding) is not a kvmemd "
            "verb")

    def _rearrange(self, order: list[int]) -> None:
        """Row i becomes old row order[i]: a row kept once moves, a row repeated is forked
        (copy-on-write), a row dropped is released."""
        self._check_usable()
        if not self._sequences:
            self._batch = len(order)
            return
        if any(not 0 <= o < self._batch for o in order):
            raise InvalidArgumentError(f"rows {order}: the batch has {self._batch}")
        used: set[int] = set()
        rows: list[Sequence] = []
        forks: list[Sequence] = []
        try:
            for o in order:
                if o in used:
                    forks.append(self._sequences[o].fork(self._lease))
                    rows.append(forks[-1])
                else:
                    rows.append(self._sequences[o])
                used.add(o)
        except BaseException:
            for seq in forks:  # nothing changed: the forks go again
                _release_quietly(seq)
            raise
        dropped = [seq for b, seq in enumerate(self._sequences) if b not in used]
        self._last_topk = [self._last_topk[o] for o in order]
        # A fork's first read finds another sequence's copy and reads itself whole.
        self._reads = [self._reads[o] for o in order]
        self._sequences, self._batch = rows, len(order)
        for seq in dropped:
            try:
                seq.release()
            except KvmemError as e:  # its lease will lapse; the rows are right already
                _log.warning("kvmem: releasing dropped row %d failed: %s", seq.id, e)

    # ---- a pass ------------------------------------------------------------------------------

    def _install_hooks(self, model: torch.nn.Module) -> list[Any]:
        decoder = model.get_decoder()
        me = weakref.ref(self)

        def begin(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            cache = me()
            if cache is not None and _passed(kwargs) is cache:
                cache._begin(args, kwargs)

        def end(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            cache = me()
            if cache is not None and _passed(kwargs) is cache:
                cache._end(output)

        hooks = [decoder.register_forward_pre_hook(begin, with_kwargs=True),
                 decoder.register_forward_hook(end, with_kwargs=True, always_call=True)]
        if "layer_distance" in self._append_signals:
            layers = decoder.layers
            mid, last = layers[len(layers) // 2 - 1], layers[len(layers) - 1]

            def keep(name: str) -> Any:
                def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
                    cache = me()
                    f = cache._forward if cache is not None else None
                    if f is not None and getattr(_current, "forward", None) is f:
                        setattr(f, name, output[0] if isinstance(output, tuple) else output)
                return hook

            hooks += [mid.register_forward_hook(keep("mid")),
                      last.register_forward_hook(keep("last"))]
        return hooks

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise FailedPreconditionError(f"KvmemCache: unusable ({self._broken}); make a new one")

    def _begin(self, args: tuple, kwargs: dict) -> None:
        self._check_usable()
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shaped = input_ids if input_ids is not None else embeds
        if shaped is None:
            raise InvalidArgumentError("KvmemCache: a pass with neither input_ids nor "
                                       "inputs_embeds")
        B, q = int(shaped.shape[0]), int(shaped.shape[1])
        if self._sequences and B != self._batch:
            raise InvalidArgumentError(f"KvmemCache: a pass of batch {B}, the cache holds "
                                       f"{self._batch} rows")
        mask = kwargs.get("attention_mask")
        if mask is None:
            real = torch.ones(B, q, dtype=torch.bool)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and \
                tuple(mask.shape) == (B, self._seen + q):
            real = mask[:, -q:].to(torch.bool).cpu()
        else:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise InvalidArgumentError(
                f"attention_mask: KvmemCache takes a 2D padding mask of shape "
                f"({B}, {self._seen + q}) (every column shown so far), not {shape}")
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs.get("cache_position")
        if positions is None:
            positions = torch.arange(self._seen, self._seen + q)
        positions = positions.to(torch.int64).cpu().expand(B, q)
        f = _Forward(real, positions, None if input_ids is None else input_ids.cpu())
        if self._sequences:
            self._read_past(f, q)
            f.want_rows = "attention_rows" in self._step_signals
        elif _compresses(self.policy):
            f.want_rows = True
            f.window = self._window
            rank = real.flip(-1).cumsum(-1).flip(-1)  # real queries at or after each one
            f.in_window = real & (rank <= f.window)
        self._forward = f
        _current.forward = f

    def _read_past(self, f: _Forward, q: int) -> None:
        """Every row's retained K/V, as [B][H][P + q][D] per layer (P: the longest stream),
        the last q slots left for the pass's new tokens (update writes them there instead
        of concatenating: one copy of the past a pass, not two)."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        reads = [self._read_row(b, q) for b in range(len(self._sequences))]
        longest = max((int(c.max()) if c.size else 0) for _, _, c, _ in reads)
        dtype = self.layout.dtype
        if len(reads) == 1:
            k, v = reads[0][0][None], reads[0][1][None]  # [1][streams][longest + q][D]
        else:
            k = np.zeros((len(reads), L * H, longest + q, D), dtype=dtype.numpy)
            v = np.zeros_like(k)
            for b, (rk, rv, _, _) in enumerate(reads):
                n = rk.shape[1] - q
                k[b, :, :n], v[b, :, :n] = rk[:, :n], rv[:, :n]
        f.counts = np.stack([c for _, _, c, _ in reads])
        f.epochs = [epoch for _, _, _, epoch in reads]
        f.past_slots = longest
        valid = torch.arange(longest)[None, None, :] < torch.from_numpy(f.counts)[:, :, None]
        f.past_valid = valid.view(len(reads), L, H, longest).transpose(0, 1)
        kt = _from_layout(k, dtype).view(len(reads), L, H, longest + q, D)
        vt = _from_layout(v, dtype).view(len(reads), L, H, longest + q, D)
        for layer in range(L):
            f.past_k[layer] = kt[:, layer]
            f.past_v[layer] = vt[:, layer]

    def _read_row(self, b: int, room: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(k, v [streams][n + room][D], counts [streams], epoch) of row b's sequence; a
        table found stale (another client changed the sequence) is fetched again. Through
        the pool, the row's last read is reused: streams that only grew copy their new rows
        (SharedPool.read_all's `since`)."""
        seq = self._sequences[b]
        for attempt in range(_STALE_RETRIES):
            try:
                if self._pool is not None:
                    read = self._pool.read_all(seq.table, room, since=self._reads[b])
                    if self._keep_reads:
                        self._reads[b] = read
                    return read.k, read.v, read.counts, read.table.epoch
                streams = sorted(seq.read_kv(), key=lambda s: (s.layer, s.kv_head))
                counts = np.array([len(s.positions) if s.positions.size else s.k.shape[0]
                                   for s in streams], dtype=np.int64)
                longest = int(counts.max()) if counts.size else 0
                D = self.layout.head_dim
                k = np.zeros((len(streams), longest + room, D), dtype=self.layout.dtype.numpy)
                v = np.zeros_like(k)
                for i, s in enumerate(streams):
                    k[i, :s.k.shape[0]], v[i, :s.v.shape[0]] = s.k, s.v
                return k, v, counts, streams[0].epoch if streams else seq.table.epoch
            except StaleEpochError:
                if attempt + 1 == _STALE_RETRIES:
                    raise
                seq.refresh_table()
        raise AssertionError("unreachable")

    def _end(self, output: Any) -> None:
        f, self._forward = self._forward, None
        _current.forward = None
        if f is None or output is None:
            return  # the pass raised (the hook runs anyway): nothing is committed
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        try:
            self._commit(f, hidden)
        except BaseException as e:
            # Rows may have committed while others did not: the sequences no longer match
            # what the model was shown.
            self._broken = f"a commit failed: {e}"
            raise

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        model = self._model()
        if model is None:
            raise FailedPreconditionError("KvmemCache: its model is gone")
        with torch.no_grad():
            return model.get_output_embeddings()(hidden).float()

    def _commit(self, f: _Forward, hidden: torch.Tensor) -> None:
        B, q = f.real.shape
        first = not self._sequences
        if first:
            self._batch = B
            self._last_topk = [float("nan")] * B
        new_k = torch.stack([f.new_k[layer] for layer in range(self.layout.num_layers)], dim=1)
        new_v = torch.stack([f.new_v[layer] for layer in range(self.layout.num_layers)], dim=1)
        rows = []
        for b in range(B):
            idx = torch.nonzero(f.real[b]).flatten()
            rows.append(self._row(f, b, idx, hidden, new_k, new_v, first))
        if first:
            self._create(f, rows)
        else:
            self._step(f, rows)
        self._seen += q

    def _row(self, f: _Forward, b: int, idx: torch.Tensor, hidden: torch.Tensor,
             new_k: torch.Tensor, new_v: torch.Tensor, first: bool) -> dict[str, Any]:
        """One row's part of the commit: its real tokens' K/V and signals."""
        L, H = self.layout.num_layers, self.layout.num_kv_heads
        n = int(idx.numel())
        row: dict[str, Any] = {"n": n}
        if n == 0:
            return row
        row["positions"] = [int(p) for p in f.positions[b, idx]]
        row["token_ids"] = None if f.token_ids is None else [int(t) for t in f.token_ids[b, idx]]
        row["k"] = _to_layout(new_k[b][:, :, idx.to(new_k.device)], self.layout.dtype)
        row["v"] = _to_layout(new_v[b][:, :, idx.to(new_v.device)], self.layout.dtype)
        last = int(idx[-1])
        need_stats = not first and "logit_stats" in self._step_signals
        need_entropy = "token_entropy" in self._append_signals
        if need_stats or need_entropy:
            summaries = [_logit_summary(x) for x in self._logits(hidden[b, idx])] \
                if need_entropy else [_logit_summary(self._logits(hidden[b, last]))]
            if need_stats:
                e, p1, p2, _ = summaries[-1]
                row["logit_stats"] = LogitStats(e, p1, p2)
            if need_entropy:
                # A token's entropy is that of the distribution that predicted it; the
                # sequence's first gets the mean of the others (Session::TokenEntropy).
                entropy = [self._last_topk[b]] + [s[3] for s in summaries[:-1]]
                if np.isnan(entropy[0]):
                    entropy[0] = float(np.mean(entropy[1:])) if n > 1 else 0.0
                row["token_entropy"] = entropy
            self._last_topk[b] = summaries[-1][3]
        if f.mid is not None and f.last is not None:
            a, c = f.mid[b, idx].double(), f.last[b, idx].double()
            cos = (a * c).sum(-1) / (a.norm(dim=-1) * c.norm(dim=-1)).clamp_min(1e-300)
            row["layer_distance"] = [float(x) for x in (1 - cos).clamp(0, 2)]
        counts = f.counts[b] if f.counts.size else np.zeros(L * H, dtype=np.int64)
        P = f.past_valid.shape[-1] if f.past_valid is not None else 0
        new_cols = (P + idx).tolist()

        def signals(by_layer: dict[int, torch.Tensor]) -> list[StreamSignal]:
            out = []
            for layer in range(L):
                grid = by_layer[layer][b].cpu()
                for h in range(H):
                    c = int(counts[layer * H + h])
                    values = torch.cat([grid[h, :c], grid[h, new_cols]]).numpy()
                    out.append(StreamSignal(layer, h, values))
            return out

        if f.rows:
            row["attention"] = signals(f.rows)
        if f.windows:
            row["window_scores"] = signals(f.windows)
        return row

    def _new_tokens(self, row: dict[str, Any]) -> NewTokens:
        return NewTokens(row["positions"], row["k"], row["v"], row["token_ids"],
                         row.get("token_entropy"), row.get("layer_distance"))

    def _create(self, f: _Forward, rows: list[dict[str, Any]]) -> None:
        for b, row in enumerate(rows):
            prompt = None
            # Published blocks hold positions 0, 1, ...: only a row whose prompt sits there
            # may map them (a left-padded row given no position ids does not).
            at_zero = row["n"] > 0 and row["positions"] == list(range(row["n"]))
            if self._prefix is not None and row.get("token_ids") and at_zero:
                prompt = Prompt(row["token_ids"], self._prefix.cache_salt,
                                self._prefix.model or "", self._prefix.auto_publish)
            seq = self.client.create_sequence(self.layout, self.policy, lease=self._lease,
                                              prompt=prompt)
            self._sequences.append(seq)
            self._reads.append(None)
            if row["n"] == 0:
                continue
            skip = seq.reused_prefix_tokens  # mapped from published blocks already
            if skip < row["n"]:
                self._append(seq, row, skip)
            if _compresses(self.policy):
                c = seq.compress(window_scores=row.get("window_scores", ()),
                                 attention=row.get("attention", ()))
                self.evicted_tokens += c.evicted_tokens

    def _append(self, seq: Sequence, row: dict[str, Any], skip: int) -> None:
        """The prompt's tokens from `skip` on, in message-sized chunks applied all or none."""
        n = row["n"]
        per_token = 2 * self.layout.streams * self.layout.head_dim * \
            self.layout.dtype.itemsize + 64
        chunk = max(1, (self._max_message_bytes // 2) // per_token) if \
            self._max_message_bytes else n

        def part(lo: int, hi: int) -> NewTokens:
            def cut(values: Optional[list]) -> Optional[list]:
                return None if values is None else values[lo:hi]
            return NewTokens(row["positions"][lo:hi], row["k"][:, :, lo:hi],
                             row["v"][:, :, lo:hi], cut(row["token_ids"]),
                             cut(row.get("token_entropy")), cut(row.get("layer_distance")))

        if n - skip <= chunk:
            self.client.append(seq.id, part(skip, n), seq.table)
        else:
            seq.append_stream(part(lo, min(n, lo + chunk)) for lo in range(skip, n, chunk))

    def _step(self, f: _Forward, rows: list[dict[str, Any]]) -> None:
        entries, which = [], []
        for b, row in enumerate(rows):
            if row["n"] == 0:
                continue  # nothing new in this row (all padding)
            step = StepArgs(f.epochs[b], row.get("logit_stats"), row.get("attention", ()))
            entries.append(BatchEntry(self._sequences[b], self._new_tokens(row), step))
            which.append(b)
        if not entries:
            return
        results = self.client.step_batch(entries)
        failed = [(b, r.error) for b, r in zip(which, results) if r.error is not None]
        for r in results:
            if r.step is not None:
                self.evicted_tokens += r.step.evicted_tokens
        self.steps += 1
        if failed:
            raise failed[0][1]  # the first failing row's, unchanged (its code and details)


def _release_quietly(seq: Sequence) -> None:
    try:
        seq.release()
    except KvmemError as e:
        _log.warning("kvmem: releasing sequence %d failed: %s", seq.id, e)


def _passed(kwargs: dict) -> Any:
    """The cache a decoder pass was given: `past_key_values` up to transformers 5.2, `cache`
    in later lines."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


# model -> [its open caches, the attention implementation it had before the first]
_switched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_switched_lock = threading.Lock()


def _switch(model: torch.nn.Module) -> None:
    with _switched_lock:
        entry = _switched.get(model)
        if entry is None:
            entry = _switched[model] = [0, model.config._attn_implementation]
        entry[0] += 1
        if model.config._attn_implementation != ATTENTION:
            model.set_attn_implementation(ATTENTION)


def _remove(hooks: list[Any], pool: Optional[SharedPool],
            model_ref: Callable[[], Optional[torch.nn.Module]]) -> None:
    for h in hooks:
        h.remove()
    if pool is not None:
        pool.close()
    model = model_ref()
    with _switched_lock:
        entry = _switched.get(model) if model is not None else None
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del _switched[model]
            if entry[1] and entry[1] != ATTENTION and \
                    model.config._attn_implementation == ATTENTION:
                model.set_attn_implementation(entry[1])


__all__ = ["ATTENTION", "CACHE_ARGUMENT", "KvmemCache", "Memory", "PrefixSharing", "kvmem_attention", "register"]
