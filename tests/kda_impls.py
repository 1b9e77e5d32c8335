"""KDA kernels as checker implementations: `impl(d)` callables over a registry input dict, for
`k3lab.harness.checker.check(op, case, impl=...)`. The tests pass the kernel entry point (the CuTe wrapper on
a GPU, the CPU emulator's run_* in CI) as an argument: nothing is patched."""
from k3lab import registry

DEC, VER, PRE = (registry.get(n) for n in ("kda_decode", "kda_verify", "kda_prefill"))


def _a(d):
    return d["qkv"], d["f"], d["b"], d["gate"], d["params"], d["state"], d["conv_state"], d["out"]


def decode(fn, **kw):
    def impl(d):
        fn(*_a(d), **kw)
    impl.__name__ = f"{getattr(fn, '__module__', '')}.{fn.__name__}{kw}"
    return impl


def verify(fn, **kw):
    def impl(d):
        fn(*_a(d), d["state_hist"], d["conv_hist"], lengths=d.get("lengths"), **kw)
    impl.__name__ = f"{getattr(fn, '__module__', '')}.{fn.__name__}{kw}"
    return impl


def prefill(fn, case, **kw):
    def impl(d):
        fn(*_a(d), chunk=case["chunk"], inverse=case["inverse"], grouped=case["grouped"], **kw)
    impl.__name__ = f"{getattr(fn, '__module__', '')}.{fn.__name__}{kw}"
    return impl


def dcase(B, H):
    return DEC.case(heads=H, batch=B)


def vcase(B, H, T, ragged=False):
    return VER.case(heads=H, batch=B, T=T, ragged=ragged)


def pcase(B, H, L, chunk=64, inverse="fp32", grouped=False, state_dtype="fp32"):
    return PRE.case(heads=H, batch=B, L=L, chunk=chunk, inverse=inverse, grouped=grouped, state_dtype=state_dtype)
