"""AITER (ROCm) kernels. None are written yet: the `aiter` backend is refused with a clear message by
`k3lab.switches.require_backend` on machines without ROCm, and by the components on ROCm until a
kernel lands here."""
