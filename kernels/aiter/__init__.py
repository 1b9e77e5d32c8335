"""AITER (ROCm) adapters: `mla_decode` runs AITER's MLA decode on k3lab's latent cache (heads padded to 16, DCP
shards merged by k3lab's lse merge). They run only on ROCm GPUs with AITER installed; elsewhere the components
refuse backend 'aiter' by name (tests/test_mla_aiter.py checks the adapter against a stand-in)."""
