"""Benchmarks that measure this machine and record its figures: loaders.py (loader throughput
against the decode bound, per backend and resolution), bare_loaders.py (the bounds, and FFCV and
DALI as their own examples use them), models.py (model-bound img/s of train and eval steps),
conversion.py (the converters' throughput and output sizes), loop_overhead.py (what our training
loop's machinery costs), object_store_clients.py (object-storage client libraries compared),
hardware.py (the hardware signature and the per-machine results file in results/), report.py (the
report and plots made from those files). Beside them, what `loaders.py --remote` reads through:
remote_sources.py, loopback_servers.py (nginx and an S3 server on 127.0.0.1, also the tests') and
latency_proxy.py (a round trip added to every request).
"""
