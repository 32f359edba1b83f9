"""The reference's log-probabilities over the corpus windows, and every row scored against them.

The windows are ``windows``' (``split_windows``: non-overlapping, the first token of each unscored); a
row's per-position values are a ``token_scores.TokenScores``.

For a model with log-probabilities ``log q`` and the reference's ``log p`` at each scored position::

    nll_t  = -log q(x_t)
    ppl    = exp(mean nll),   SE(ppl) = ppl * SE(mean nll)          (delta method, as mlx-lm reports it)
    KL_t   = sum_v p(v) (log p(v) - log q(v))                       (nats, reference || model)
    top1_t = [argmax p == argmax q]

Memory is bounded by one chunk of positions, never by the corpus (docs/eval-memory.md): a window's
logits are made ``chunk`` positions at a time from the model's final hidden states (``lm_head`` on a
slice, where that gives exactly the model's own logits: ``split_head``), each chunk's float32
log-softmax is used and dropped, and the reference's log-probabilities are written once to an unnamed
temporary file and read back chunk by chunk into one reused buffer for every row's KL. ``chunk`` is
``LOGPROB_CHUNK_BYTES // (4 V)`` positions. The values are bit for bit those of one forward pass and
one log-softmax per window (tests/test_eval_memory.py).
"""

from __future__ import annotations

import shutil
import tempfile

import torch

from qkit.dtypes import dtype_of, non_finite_activations
from qkit.errors import InputError, OutputError
from qkit.evaluation.token_scores import MIN_SCORED, TokenScores
from qkit.evaluation.windows import split_windows


def position_logprobs(model, window_ids: torch.Tensor) -> torch.Tensor:
    """log-softmax over the vocabulary at each position but the last: float32 ``[w-1, V]``, from one
    forward pass (the whole window's logits at once; ``CorpusReference`` makes them chunk by chunk).

    An inference tensor (``torch.inference_mode``): read it anywhere, modify it only in inference mode."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=window_ids[None].to(device), use_cache=False).logits[0, :-1]
        # .float() is no copy for a float32 model; half-precision logits get their log-softmax in float32
        return torch.log_softmax(logits.float(), dim=-1).cpu()


KL_CHUNK = 512  # kl_per_position's default rows per block of [chunk, V] temporaries
LOGPROB_CHUNK_BYTES = 64 << 20  # one float32 [chunk, V] block of log-probabilities: 341 positions at V = 49152
SPLIT_PROBE_TOKENS = 8  # tokens of the forward pass that checks a model's head can be applied chunk by chunk


MIN_CHUNK = 16  # positions: BLAS rounds a product of fewer rows differently (docs/eval-memory.md)


def chunk_positions(vocab: int, chunk_bytes: int = LOGPROB_CHUNK_BYTES) -> int:
    """Positions per chunk: ``max(MIN_CHUNK, chunk_bytes // (4 * vocab))``, so one float32 ``[chunk, V]``
    block of log-probabilities is at most ``chunk_bytes`` (16 positions when the vocabulary is larger
    than ``chunk_bytes / 64``: 1M tokens at 64 MiB)."""
    return max(MIN_CHUNK, chunk_bytes // (4 * vocab))


def _kl_rows(p_lp: torch.Tensor, q_lp: torch.Tensor, diff: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """``sum_v exp(p) (p - q)`` per row, float32 ``[m]``, from float32 ``[m, V]``: ``diff`` receives
    ``p - q``, then ``prob`` receives ``exp(p)`` (``prob`` may be ``p_lp`` itself: it is read first) and
    is multiplied in. The same elementwise float32 operations as ``(p.exp() * (p - q)).sum(-1)``
    (multiplication commutes exactly) and the same row sums, into reused ``[m, V]`` buffers (a fresh
    100 MB block costs page faults on every row)."""
    d = torch.sub(p_lp, q_lp, out=diff)
    return d.mul_(torch.exp(p_lp, out=prob)).sum(-1)


def kl_per_position(ref_lp: torch.Tensor, lp: torch.Tensor, ref_probs: torch.Tensor | None = None,
                    chunk: int = KL_CHUNK) -> torch.Tensor:
    """``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))`` per row: float64 ``[n]`` from float32 ``[n, V]``.

    ``ref_lp`` is ``log p`` (the reference), ``lp`` is ``log q``; ``ref_probs``, when given, is
    ``ref_lp.exp()`` computed once. The values are exactly those of
    ``(ref_lp.exp() * (ref_lp - lp)).sum(-1).double()`` computed ``chunk`` rows at a time, written into
    reused ``[chunk, V]`` buffers instead of fresh ones per chunk."""
    n, v = lp.shape
    out = torch.empty(n, dtype=torch.float64)
    with torch.inference_mode():
        diff = torch.empty((min(chunk, n), v), dtype=lp.dtype)
        prob = torch.empty_like(diff) if ref_probs is None else None
        for s in range(0, n, chunk):
            p_lp, q_lp = ref_lp[s : s + chunk], lp[s : s + chunk]
            m = p_lp.shape[0]
            if ref_probs is None:
                out[s : s + m] = _kl_rows(p_lp, q_lp, diff[:m], prob[:m])
            else:
                out[s : s + m] = torch.sub(p_lp, q_lp, out=diff[:m]).mul_(ref_probs[s : s + chunk]).sum(-1)
    return out


def split_head(model, probe_ids: torch.Tensor) -> bool:
    """True when ``model``'s logits are exactly its output embedding (``lm_head``) applied to its
    decoder's last hidden state, so they can be made a chunk of positions at a time. Checked, not
    assumed: one forward pass over the first ``SPLIT_PROBE_TOKENS`` of ``probe_ids`` each way must give
    equal tensors (a model that scales or soft-caps its logits, or whose decoder cannot be called on its
    own, is scored from whole-window logits instead: the same values, one ``[w, V]`` per window)."""
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    if decoder is None or head is None or decoder is model:
        return False
    ids = probe_ids[:SPLIT_PROBE_TOKENS][None].to(next(model.parameters()).device)
    try:
        with torch.inference_mode():
            full = model(input_ids=ids, use_cache=False).logits[0]
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state[0])
    except (TypeError, AttributeError, ValueError, RuntimeError, IndexError):
        return False
    return full.shape == split.shape and full.dtype == split.dtype and torch.equal(full, split)


class _WindowLogprobs:
    """One window's log-probabilities a chunk of positions at a time: float32 ``[m, V]`` per chunk.

    Split (``split_head``): one decoder pass, then ``lm_head`` on each chunk of the final hidden states
    ``[w, H]``: no ``[w, V]`` tensor exists. Otherwise one whole forward pass, its ``[w, V]`` logits held
    while their chunks are read. The chunks cover all ``w`` positions, the last one too (its prediction
    is past the window and dropped), in ``ceil(w / chunk)`` spans of nearly equal size, none shorter
    than ``MIN_CHUNK`` rows (so a span may reach ``2 * chunk`` rows when ``chunk`` is under
    ``2 * MIN_CHUNK``): a window of at most ``chunk`` tokens is one matrix product of exactly the shape
    the model's own forward pass computes, and no span is a handful of rows (BLAS computes a product of
    fewer than about 12 rows with other kernels, whose float32 sums round differently: measured on the
    default model and the tiny test model)."""

    def __init__(self, model, window_ids: torch.Tensor, split: bool, chunk: int | None):
        self.head = model.get_output_embeddings() if split else None
        ids = window_ids[None].to(next(model.parameters()).device)
        with torch.inference_mode():
            if split:
                self.states = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
            else:
                self.states = model(input_ids=ids, use_cache=False).logits[0]
        vocab = int(self.head.weight.shape[0]) if self.head is not None else int(self.states.shape[-1])
        self.chunk_size = chunk = chunk or chunk_positions(vocab)  # None: from the vocabulary
        w = int(self.states.shape[0])
        self.n = w - 1  # scored positions
        k = max(1, min(-(-w // chunk), w // MIN_CHUNK))  # spans of at most ``chunk``, never fewer than MIN_CHUNK rows
        bounds = [w * j // k for j in range(k + 1)]
        self.spans = [(a, b) for a, b in zip(bounds, bounds[1:])]

    def chunk(self, start: int, stop: int) -> torch.Tensor:
        """Positions ``start .. min(stop, n)``: float32 ``[m, V]``."""
        with torch.inference_mode():
            x = self.states[start:stop]
            logits = self.head(x) if self.head is not None else x
            logits = logits[: min(stop, self.n) - start]
            # .float() is no copy for a float32 model; half-precision logits get their log-softmax in float32
            return torch.log_softmax(logits.float(), dim=-1).cpu()


class _RowStore:
    """float32 rows of ``V`` values, appended once in order, read back by row range into a caller's buffer.

    An unnamed temporary file in ``$TMPDIR`` (``tempfile.TemporaryFile``: unlinked as it is created), so
    nothing is left behind, whatever ends the process (an exception, Ctrl-C, SIGKILL). Plain reads into a
    reused buffer, not a memory map: a mapped file's touched pages count in the process's resident memory;
    read pages stay only in the page cache, which the kernel reclaims."""

    def __init__(self):
        try:
            self.file = tempfile.TemporaryFile(prefix="qkit-logprobs-")
        except OSError as exc:
            raise OutputError(f"cannot create a temporary file in {tempfile.gettempdir()} for the reference's "
                              f"log-probabilities ({exc.strerror or exc}); set TMPDIR to a writable directory") from exc
        self.vocab: int | None = None
        self.rows = 0
        self.path: str | None = None  # named once shared (``share``): then it pickles as its path

    def append(self, rows: torch.Tensor) -> None:
        """Append float32 ``[m, V]`` rows (contiguous, on the CPU)."""
        self.vocab = self.vocab or int(rows.shape[1])
        try:
            self.file.write(memoryview(rows.contiguous().numpy()).cast("B"))
        except OSError as exc:
            raise OutputError(f"cannot write the reference's log-probabilities to {tempfile.gettempdir()} "
                              f"({exc.strerror or exc}); free space there or set TMPDIR elsewhere") from exc
        self.rows += int(rows.shape[0])

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``start .. start + len(out)`` into ``out`` (float32 ``[m, V]``, contiguous); returns ``out``."""
        row_bytes = 4 * self.vocab
        self.file.flush()
        self.file.seek(start * row_bytes)
        want = int(out.shape[0]) * row_bytes
        if self.file.readinto(memoryview(out.numpy()).cast("B")) != want:
            raise OutputError(f"the reference's log-probabilities in {tempfile.gettempdir()} were cut short; "
                              "free space there and run the eval again")
        return out

    def share(self, path) -> None:
        """Copy the rows into the named file ``path`` (16 MiB at a time) and read them from there from now
        on, so that this store pickles as its path: a process on this machine (a Ray worker) opens the same
        file. The caller removes ``path`` (an open store reads on after it is unlinked)."""
        self.file.flush()
        self.file.seek(0)
        try:
            with open(path, "wb") as out:
                shutil.copyfileobj(self.file, out, 16 << 20)
        except OSError as exc:
            raise OutputError(f"cannot copy the reference's log-probabilities to {path} ({exc.strerror or exc}); "
                              "free space there or set TMPDIR elsewhere") from exc
        self.file.close()
        self.file, self.path = open(path, "rb"), str(path)

    def __getstate__(self) -> dict:
        if self.path is None:
            raise TypeError("the reference's log-probabilities are in an unnamed file; share() them to pickle them")
        return {"path": self.path, "vocab": self.vocab, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.file = open(state["path"], "rb")

    def close(self) -> None:
        self.file.close()


class CorpusReference:
    """The reference's log-probabilities over the corpus windows, computed once, held on disk.

    ``ref_argmax``: int64 ``[w-1]`` per window; ``ref_nll``: float64 ``[w-1]`` per window; the float32
    ``[w-1, V]`` log-probabilities of every window are in an unnamed temporary file (``logprobs(i)``
    reads window ``i`` back), removed when this object is closed or collected. ``chunk``: positions per
    block (default ``chunk_positions(V)``). Memory beyond the model: one window's final hidden states
    and a few ``[chunk, V]`` float32 blocks, whatever the corpus length."""

    def __init__(self, model, ids: torch.Tensor, window: int, chunk: int | None = None,
                 segments: tuple[tuple[str, int], ...] = ()):
        # segments: (name, tokens) of each domain, in order: windows never cross one (one text: ())
        starts = torch.tensor([0, *(n for _, n in segments)]).cumsum(0).tolist()
        parts = [ids[a:b] for a, b in zip(starts, starts[1:])] if segments else [ids]
        per = [split_windows(part, window) for part in parts]
        self.windows = [w for ws in per for w in ws]
        self.domains = tuple((name, sum(int(w.numel()) - 1 for w in ws)) for (name, _), ws in zip(segments, per))
        if self.scored_tokens < MIN_SCORED:  # the runner refuses this before loading; a library caller here
            raise InputError(f"the corpus scores {self.scored_tokens} position(s) in windows of {window} tokens; a "
                             f"standard error needs {MIN_SCORED}: pass a longer text")
        self.split = split_head(model, self.windows[0])
        self.chunk = chunk
        self.offsets: list[int] = []  # first row of each window in the store
        self.ref_argmax: list[torch.Tensor] = []
        self.ref_nll: list[torch.Tensor] = []
        self._store = _RowStore()
        try:
            for w in self.windows:
                self.offsets.append(self._store.rows)
                win = _WindowLogprobs(model, w, self.split, self.chunk)
                self.chunk = win.chunk_size
                tops, nlls = [], []
                for s, e in win.spans:
                    lp = win.chunk(s, e)
                    if bool(torch.isnan(lp).any()):  # log_softmax of an inf or a NaN logit
                        # every row is compared with these: a reference of NaN or inf measures nothing (an fp16 overflow)
                        raise non_finite_activations("the reference's log-probabilities on the corpus", dtype_of(model))
                    self._store.append(lp)
                    tops.append(lp.argmax(-1))
                    nlls.append(-lp.gather(1, w[1 + s : 1 + s + lp.shape[0], None]).squeeze(1).double())
                    del lp
                self.ref_argmax.append(torch.cat(tops))
                self.ref_nll.append(torch.cat(nlls))
                del win
        except BaseException:
            self.close()
            raise

    @property
    def scored_tokens(self) -> int:
        return sum(w.numel() - 1 for w in self.windows)

    @property
    def vocab(self) -> int:
        return int(self._store.vocab)

    def logprobs(self, i: int) -> torch.Tensor:
        """Window ``i``'s reference log-probabilities read back: float32 ``[w-1, V]`` (a fresh tensor)."""
        out = torch.empty((int(self.windows[i].numel()) - 1, self.vocab), dtype=torch.float32)
        return self._store.read(self.offsets[i], out)

    @property
    def ref_logprobs(self) -> list[torch.Tensor]:
        """Every window's reference log-probabilities, read back into memory (for tests and small corpora:
        this is the ``[tokens, V]`` the eval itself never holds)."""
        return [self.logprobs(i) for i in range(len(self.windows))]

    def own_scores(self) -> TokenScores:
        """The reference's own scores, from the stored NLLs (no second forward pass)."""
        nll = torch.cat(self.ref_nll)
        return TokenScores(nll, torch.zeros_like(nll), torch.ones(nll.numel(), dtype=torch.bool), domains=self.domains)

    def score(self, model, chunk: int | None = None) -> TokenScores:
        """Score ``model`` on the same windows against the stored reference: one forward pass per window
        (``lm_head`` a chunk at a time when ``split_head`` held for the reference), then, chunk by chunk,
        the NLL of each target, the KL against the reference's rows read back from disk, and the top-1
        match. Two reused float32 ``[chunk, V]`` buffers (the reference's rows, ``p - q``) plus the chunk's
        own logits and log-softmax."""
        chunk = chunk or self.chunk
        nll, kl, top1 = [], [], []
        measurable = True
        ref_buf = diff = torch.empty(0)
        for i, w in enumerate(self.windows):
            win = _WindowLogprobs(model, w, self.split, chunk)
            for s, e in win.spans:
                lp = win.chunk(s, e)
                m = int(lp.shape[0])
                if m > ref_buf.shape[0]:  # allocated once: every span but a window's last holds the most rows
                    with torch.inference_mode():
                        ref_buf = torch.empty((m, self.vocab), dtype=torch.float32)
                        diff = torch.empty_like(ref_buf)
                nll.append(-lp.gather(1, w[1 + s : 1 + s + m, None]).squeeze(1).double())
                top1.append(lp.argmax(-1) == self.ref_argmax[i][s : s + m])
                measurable = measurable and not bool(torch.isnan(lp).any())
                ref = self._store.read(self.offsets[i] + s, ref_buf[:m])
                with torch.inference_mode():
                    kl.append(_kl_rows(ref, lp, diff[:m], ref).double())  # exp(p) over p: read already
                del lp  # freed before the next chunk's logits
            del win
        return TokenScores(torch.cat(nll), torch.cat(kl).clamp_(min=0.0), torch.cat(top1), measurable, self.domains)

    def share(self, path) -> None:
        """The log-probabilities copied to the named file ``path``, read from there from now on: this
        reference then pickles without them (``_RowStore.share``), for another process on this machine."""
        self._store.share(path)

    def close(self) -> None:
        """Remove the temporary file (also done when this object is collected)."""
        self._store.close()

    def __del__(self):
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()
