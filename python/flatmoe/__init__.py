"""flatmoe: a ctypes binding of libflatmoe (include/flatmoe.h; docs/rl.md), NumPy arrays in and out.

    import numpy as np, flatmoe
    s = flatmoe.Session("--init-from", "path/to/hf_folder", "--seq-len", "4096", "--micro-batch", "4")
    logp, ent = s.logprobs(tokens, seq_lens)                  # [N] float32 each
    logp, ent, routes = s.logprobs(tokens, seq_lens, routes=True)  # + int32 [N, num_moe_layers, top_k]
    stats = s.train_step(tokens, seq_lens, ..., routed_experts=routes)  # routing replay (R3)
    stats = s.train_step(tokens, seq_lens, loss_mask=mask, advantages=adv,
                         old_logprobs=old, loss="pg", agg="seq-mean-token-mean",
                         clip_low=0.2, clip_high=0.28, kl="k3", kl_coef=0.001, ref_logprobs=ref)
    toks, lens, lp = s.generate([prompt0, prompt1], max_new=32, temperature=1.0, top_p=0.95, seed=1)
    weights = s.weights_bf16()                                # {HF name: uint16 bf16 bits}; or s.export_weights(n, fn)
    s.save("runs/rl")                                         # runs/rl/step_NNNNNN; Session("--ckpt", "runs/rl", ...)

The library is found at $FLATMOE_LIB, else on the loader's path (cmake --install puts both in
PREFIX/lib) as libflatmoe-cuda.so (the CUDA build's) when the first Session's options say
"--backend", "cuda", and as libflatmoe.so (the CPU build's) otherwise. One process loads one. Errors raise FlatmoeError with the library's message.

Many ranks (docs/rl.md "Many ranks"): run the script under mpirun; every rank opens the Session with the
same options and calls logprobs / train_step / save / export_weights together, each with its own share
of the batch (Session.info's "rank" and "n_ranks" say which). MPI is initialized by the library at the
first Session unless the process did it already (e.g. `from mpi4py import MPI` first); when the library
initialized it, this module finalizes it at exit (flatmoe.finalize(), after the sessions are closed),
else the owner (mpi4py) does.
"""
import atexit
import ctypes
import os
import sys
import weakref

import numpy as np

__all__ = ["Session", "FlatmoeError", "finalize"]

_i64 = ctypes.c_int64


class FlatmoeError(RuntimeError):
    """A libflatmoe error: .code is the status (FLATMOE_ERR_*), str() the library's message."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


_ABI_VERSION = 3  # include/flatmoe.h FLATMOE_ABI_VERSION: the struct layouts below


class _Info(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("vocab_size", "micro_batch", "seq_len", "token_budget", "num_layers",
                                    "num_experts", "hidden_size", "step", "num_moe_layers", "top_k", "rank",
                                    "n_ranks", "ep")]


class _Batch(ctypes.Structure):
    _fields_ = [("n_tokens", _i64), ("tokens", ctypes.c_void_p), ("n_seqs", _i64), ("seq_lens", ctypes.c_void_p),
                ("loss_mask", ctypes.c_void_p), ("advantages", ctypes.c_void_p), ("old_logprobs", ctypes.c_void_p),
                ("rollout_logprobs", ctypes.c_void_p), ("ref_logprobs", ctypes.c_void_p),
                ("routed_experts", ctypes.c_void_p)]


class _LossSpec(ctypes.Structure):
    _fields_ = [("loss", ctypes.c_int), ("agg", ctypes.c_int), ("clip_low", ctypes.c_double),
                ("clip_high", ctypes.c_double), ("clip_dual", ctypes.c_double), ("tis_cap", ctypes.c_double),
                ("kl", ctypes.c_int), ("kl_coef", ctypes.c_double), ("entropy_coef", ctypes.c_double)]


_STAT_DOUBLES = ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac", "clip_frac_low", "clip_frac_high",
                 "dual_clip_frac", "tis_mean", "router_aux", "router_z", "grad_norm", "lr")


class _Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_double) for n in _STAT_DOUBLES] + [
        ("n_loss_tokens", _i64), ("n_loss_seqs", _i64), ("step", _i64)]


class _Piece(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int), ("shape", _i64 * 2),
                ("tensor_bytes", _i64), ("offset", _i64), ("nbytes", _i64), ("data", ctypes.c_void_p)]


class _SampleSpec(ctypes.Structure):
    _fields_ = [("max_new", _i64), ("temperature", ctypes.c_double), ("top_k", _i64), ("top_p", ctypes.c_double),
                ("seed", ctypes.c_uint64), ("stop_token", ctypes.c_int32)]


_BUCKET_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Piece), ctypes.c_int)

_LOSS = {"sft": 0, "pg": 1}
_AGG = {"token-mean": 0, "seq-mean-token-sum": 1, "seq-mean-token-mean": 2}
_KL = {None: 0, "none": 0, "k1": 1, "k3": 2}

_lib = None


def _default_lib(options):
    """libflatmoe-cuda.so where the options name --backend cuda (either spelling), else libflatmoe.so."""
    opts = [str(o) for o in options]
    cuda = "--backend=cuda" in opts or any(a == "--backend" and b == "cuda" for a, b in zip(opts, opts[1:]))
    return "libflatmoe-cuda.so" if cuda else "libflatmoe.so"


def _load(options=()):
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(os.environ.get("FLATMOE_LIB") or _default_lib(options))
        lib.flatmoe_last_error.restype = ctypes.c_char_p
        abi = lib.flatmoe_abi_version() if hasattr(lib, "flatmoe_abi_version") else 1
        if abi != _ABI_VERSION:
            raise FlatmoeError(7, f"libflatmoe's ABI version is {abi}, this binding's {_ABI_VERSION} "
                                  f"(include/flatmoe.h FLATMOE_ABI_VERSION); use the binding of the library loaded "
                                  f"({os.environ.get('FLATMOE_LIB', 'libflatmoe.so')})")
        lib.flatmoe_open.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.flatmoe_close.argtypes = [ctypes.c_void_p]
        lib.flatmoe_close.restype = None
        lib.flatmoe_get_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Info)]
        lib.flatmoe_logprobs.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Batch), ctypes.c_void_p, ctypes.c_void_p]
        lib.flatmoe_logprobs_ex.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Batch), ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_void_p, _i64, ctypes.c_void_p,
                                            ctypes.c_void_p]
        lib.flatmoe_train_step.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Batch), ctypes.POINTER(_LossSpec),
                                           ctypes.POINTER(_Stats)]
        lib.flatmoe_save.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.flatmoe_export_weights.argtypes = [ctypes.c_void_p, _i64, _BUCKET_FN, ctypes.c_void_p]
        lib.flatmoe_generate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _i64, ctypes.c_void_p,
                                         ctypes.POINTER(_SampleSpec), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.flatmoe_finalize.argtypes = []
        lib.flatmoe_set_environment.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        lib.flatmoe_sleep.argtypes = [ctypes.c_void_p]
        lib.flatmoe_wake.argtypes = [ctypes.c_void_p]
        _lib = lib
        atexit.register(_at_exit)
    return _lib


_sessions = weakref.WeakSet()  # the open sessions, closed before MPI is finalized


def finalize():
    """Closes every open Session, then MPI_Finalize when MPI is initialized and not yet finalized
    (flatmoe_finalize). Called at exit when the library initialized MPI; call it yourself only then."""
    for s in list(_sessions):
        s.close()
    if _lib is not None:
        _check(_lib.flatmoe_finalize())


def _at_exit():
    # mpi4py, when imported, owns MPI (it initialized it, or will finalize it): leave it to it
    if "mpi4py.MPI" not in sys.modules:
        finalize()


def _check(rc):
    if rc != 0:
        raise FlatmoeError(rc, _lib.flatmoe_last_error().decode("utf-8", "replace"))


def _conv(x, dtype, name):
    """x as a C-contiguous array of dtype, refusing what a cast would change silently: integer arrays
    (tokens, seq_lens, routes) must hold integers in dtype's range, loss_mask only 0 and 1, float arrays
    real numbers (ValueError naming the input, the value found and the fix)."""
    a = np.asarray(x)
    if a.size == 0:
        return np.ascontiguousarray(a, dtype=dtype)
    k = a.dtype.kind
    if dtype is np.uint8:  # loss_mask: bool, or 0/1 in any real dtype (e.g. verl's float response_mask)
        if k not in "biuf":
            raise ValueError(f"{name}: expected 0 or 1 per token (bool, int or float), found dtype {a.dtype}")
        bad = np.flatnonzero(~((a == 0) | (a == 1)).reshape(-1))
        if bad.size:
            raise ValueError(f"{name}: expected 0 or 1 per token (bool, int or float), found {a.reshape(-1)[bad[0]]!r} "
                             f"at index {int(bad[0])}; pass (mask != 0) for a mask of other values")
    elif np.issubdtype(dtype, np.integer):
        if k not in "iu":
            raise ValueError(f"{name}: expected integers, found dtype {a.dtype}; pass an integer array (a float array "
                             f"would be truncated)")
        lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
        if a.min() < lo or a.max() > hi:
            i = int(np.flatnonzero((a.reshape(-1) < lo) | (a.reshape(-1) > hi))[0])
            raise ValueError(f"{name}: expected integers within {np.dtype(dtype).name} ({lo} .. {hi}), found "
                             f"{int(a.reshape(-1)[i])} at index {i}; the library reads {np.dtype(dtype).name}, so it would "
                             f"see another number")
    elif k not in "biuf":
        raise ValueError(f"{name}: expected real numbers, found dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def _arr(x, dtype, n, name):
    """x as a C-contiguous array of dtype and length n (None stays None; n None: its own length); kept
    alive by the caller."""
    if x is None:
        return None
    a = _conv(x, dtype, name)
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = "a 1-d array" + (f" of {n} entries" if n is not None else "")
        raise ValueError(f"{name}: expected {want}, found {'a scalar' if a.ndim == 0 else f'shape {a.shape}'}")
    return a


def _choice(table, value, name):
    """table[value], or a ValueError naming the input, the choices and the value found."""
    try:
        return table[value]
    except (KeyError, TypeError):
        raise ValueError(f"{name}: expected one of {', '.join(repr(k) for k in table)}, found {value!r}") from None


def _ptr(a):
    return None if a is None else a.ctypes.data


class Session:
    """A libflatmoe session: Session(*options), options spelled as `flatmoe train`'s flags."""

    def __init__(self, *options):
        if len(options) == 1 and isinstance(options[0], (list, tuple)):
            options = tuple(options[0])
        lib = _load(options)
        env = [f"{k}={v}".encode() for k, v in os.environ.items()] + [None]  # the launcher's ranks, if any
        _check(lib.flatmoe_set_environment((ctypes.c_char_p * len(env))(*env)))
        enc = [str(o).encode() for o in options]
        argv = (ctypes.c_char_p * max(len(enc), 1))(*enc)
        h = ctypes.c_void_p()
        _check(lib.flatmoe_open(ctypes.byref(h), len(enc), argv))
        self._h = h
        self._n_ranks = self.info["n_ranks"]
        _sessions.add(self)

    @property
    def _live(self):
        """The library's handle; FlatmoeError once closed."""
        h = getattr(self, "_h", None)
        if not h:
            raise FlatmoeError(1, "Session: this session is closed (close(), or its with-block ended); open a new "
                                  "Session")
        return h

    def close(self):
        if getattr(self, "_h", None):
            _lib.flatmoe_close(self._h)
            self._h = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def info(self):
        i = _Info()
        _check(_lib.flatmoe_get_info(self._live, ctypes.byref(i)))
        return {n: getattr(i, n) for n, _ in _Info._fields_}

    def _routes_shape(self, n):
        i = self.info
        return (n, i["num_moe_layers"], i["top_k"])

    def _batch(self, tokens, seq_lens, loss_mask=None, advantages=None, old_logprobs=None, rollout_logprobs=None,
               ref_logprobs=None, routed_experts=None):
        tok = _arr(tokens, np.int32, None, "tokens")
        n = tok.shape[0]
        keep = [tok, _arr(seq_lens, np.int64, None, "seq_lens"),
                _arr(loss_mask, np.uint8, n, "loss_mask"), _arr(advantages, np.float32, n, "advantages"),
                _arr(old_logprobs, np.float32, n, "old_logprobs"), _arr(rollout_logprobs, np.float32, n, "rollout_logprobs"),
                _arr(ref_logprobs, np.float32, n, "ref_logprobs")]
        if routed_experts is None:
            keep.append(None)
        else:
            r = _conv(routed_experts, np.int32, "routed_experts")
            if r.shape != self._routes_shape(n):
                raise ValueError(f"routed_experts: expected shape [n_tokens, num_moe_layers, top_k] = "
                                 f"{list(self._routes_shape(n))}, found {list(r.shape)}")
            keep.append(r)
        b = _Batch(n, _ptr(keep[0]), keep[1].shape[0], _ptr(keep[1]), *[_ptr(a) for a in keep[2:]])
        return b, keep

    def _refuse_together(self, train):
        """Many ranks: a call this binding refuses (ValueError) still takes part in the library's agreement
        (an empty batch, which the library refuses), so the other ranks return "1 of the ranks refused"
        instead of waiting in the collective; one rank: nothing."""
        if self._n_ranks > 1:
            empty, out = _Batch(), np.empty(1, np.float32)
            if train:
                _lib.flatmoe_train_step(self._live, ctypes.byref(empty), ctypes.byref(_LossSpec()), None)
            else:
                _lib.flatmoe_logprobs_ex(self._live, ctypes.byref(empty), _ptr(out), None, None, 0, None, None)

    def logprobs(self, tokens, seq_lens, entropy=True, routes=False, routed_experts=None, topk=0):
        """Per-token log-probs (and entropies) [N] float32 of the packed sequences; 0 at each first token.
        routes=True also returns the experts each token was routed to, int32 [N, num_moe_layers, top_k]
        (the MoE layers in model order). routed_experts (same shape): replay those routes (R3).
        topk=k (<= the session's --logprobs-topk) also returns the k largest log-probs float32 [N, k] and
        their token ids int32 [N, k] (-inf and -1 at each first token).
        Returns lp, then ent, routes, topk log-probs, topk ids, each only when asked for."""
        try:
            b, keep = self._batch(tokens, seq_lens, routed_experts=routed_experts)
        except ValueError:
            self._refuse_together(False)
            raise
        lp = np.empty(b.n_tokens, np.float32)
        ent = np.empty(b.n_tokens, np.float32) if entropy else None
        rt = np.empty(self._routes_shape(b.n_tokens), np.int32) if routes else None
        tl = np.empty((b.n_tokens, max(topk, 0)), np.float32) if topk else None  # topk < 0: the library's refusal
        ti = np.empty((b.n_tokens, max(topk, 0)), np.int32) if topk else None
        _check(_lib.flatmoe_logprobs_ex(self._live, ctypes.byref(b), _ptr(lp), _ptr(ent), _ptr(rt), topk, _ptr(tl),
                                        _ptr(ti)))
        out = (lp,) + ((ent,) if entropy else ()) + ((rt,) if routes else ()) + ((tl, ti) if topk else ())
        return out if len(out) > 1 else lp

    def train_step(self, tokens, seq_lens, loss_mask=None, advantages=None, old_logprobs=None, rollout_logprobs=None,
                   ref_logprobs=None, loss="sft", agg="token-mean", clip_low=0.2, clip_high=0.2, clip_dual=0.0,
                   tis_cap=0.0, kl=None, kl_coef=0.0, routed_experts=None, entropy_coef=0.0):
        """One optimizer step; returns the step's statistics as a dict (flatmoe_step_stats).
        routed_experts: int32 [N, num_moe_layers, top_k], the routes to replay (R3), or None.
        entropy_coef: the entropy bonus c (l_t -= c H_t; verl's entropy_coeff)."""
        try:
            b, keep = self._batch(tokens, seq_lens, loss_mask, advantages, old_logprobs, rollout_logprobs,
                                  ref_logprobs, routed_experts)
            spec = _LossSpec(_choice(_LOSS, loss, "loss"), _choice(_AGG, agg, "agg"), clip_low, clip_high, clip_dual,
                             tis_cap, _choice(_KL, kl, "kl"), kl_coef, entropy_coef)
        except ValueError:
            self._refuse_together(True)
            raise
        st = _Stats()
        _check(_lib.flatmoe_train_step(self._live, ctypes.byref(b), ctypes.byref(spec), ctypes.byref(st)))
        return {n: getattr(st, n) for n, _ in _Stats._fields_}

    def save(self, run_dir):
        """A `flatmoe train` checkpoint of the session at RUN_DIR/step_NNNNNN (atomic); reopen it with
        Session("--ckpt", run_dir, *the same other options)."""
        _check(_lib.flatmoe_save(self._live, os.fsencode(run_dir)))
        return os.path.join(os.fsdecode(run_dir), "step_%06d" % self.info["step"])

    def export_weights(self, bucket_bytes, fn):
        """Streams the weights as bf16 in buckets of at most bucket_bytes (flatmoe_export_weights):
        fn(pieces) per bucket, each piece a dict name, shape (tuple), tensor_bytes, offset (bytes into
        the tensor), data (numpy uint16: the bf16 bits, a copy). A tensor that fits a bucket arrives
        whole; a larger one in consecutive pieces. An exception in fn stops the export and is raised."""
        err = []

        def cb(_user, pieces, n):
            try:
                out = []
                for k in range(n):
                    p = pieces[k]
                    shape = tuple(p.shape[d] for d in range(p.ndim))
                    data = np.ctypeslib.as_array(ctypes.cast(p.data, ctypes.POINTER(ctypes.c_uint16)),
                                                 shape=(p.nbytes // 2,)).copy()
                    out.append({"name": p.name.decode(), "shape": shape, "tensor_bytes": p.tensor_bytes,
                                "offset": p.offset, "data": data})
                fn(out)
                return 0
            except BaseException as e:  # noqa: B036: handed back across the C frame
                err.append(e)
                return 1

        c_cb = _BUCKET_FN(cb)
        rc = _lib.flatmoe_export_weights(self._live, int(bucket_bytes), c_cb, None)
        if err:
            raise err[0]
        _check(rc)

    def weights_bf16(self, bucket_bytes=64 << 20):
        """Every weight tensor, reassembled from export_weights: {name: numpy uint16 array of its shape}."""
        out = {}

        def take(pieces):
            for p in pieces:
                t = out.get(p["name"])
                if t is None:
                    t = out[p["name"]] = np.empty(p["tensor_bytes"] // 2, np.uint16)
                t[p["offset"] // 2:p["offset"] // 2 + p["data"].shape[0]] = p["data"]
                if p["offset"] + 2 * p["data"].shape[0] == p["tensor_bytes"]:
                    out[p["name"]] = t.reshape(p["shape"])

        self.export_weights(bucket_bytes, take)
        return out

    def generate(self, prompts, max_new=16, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop_token=-1):
        """Completions of the prompts (a list of 1-d token arrays) by the engine's batched sampler
        (flatmoe_generate): returns tokens [n, max_new] int32 (-1 after each completion), lens [n] int64
        and logprobs [n, max_new] float32 (the current policy's, temperature 1; 0 after each completion)."""
        ps = [_conv(p, np.int32, f"prompts[{i}]").reshape(-1) for i, p in enumerate(prompts)]
        flat = np.ascontiguousarray(np.concatenate(ps)) if ps else np.zeros(0, np.int32)
        plen = np.array([p.shape[0] for p in ps], np.int64)
        n = len(ps)
        m = max(int(max_new), 0)  # max_new < 1: the library's refusal names it
        toks = np.empty((n, m), np.int32)
        lens = np.empty(n, np.int64)
        lp = np.empty((n, m), np.float32)
        spec = _SampleSpec(max_new, temperature, top_k, top_p, seed, stop_token)
        _check(_lib.flatmoe_generate(self._live, _ptr(flat), n, _ptr(plen), ctypes.byref(spec), _ptr(toks), _ptr(lens),
                                     _ptr(lp)))
        return toks, lens, lp

    def sleep(self):
        """The device arenas (weights, gradients, master, optimizer state, activations) to host memory and
        their memory given back (flatmoe_sleep; docs/rl.md "Sleep and wake"). Other calls raise until wake()."""
        _check(_lib.flatmoe_sleep(self._live))

    def wake(self):
        """Restores the model state flatmoe_sleep moved: the next steps as if it had not slept."""
        _check(_lib.flatmoe_wake(self._live))
