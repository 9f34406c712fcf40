"""Several serving engines in processes of their own on one GPU: static splits, one shared vkv
budget, kvcached (``python -m lab.multi_engine``)."""
