"""The DDP training loop: main.py (the torchrun entry point), config.py and typed_config.py
(every key of a run's config, checked), trainer.py (the loop; run_setup.py builds it, run_records.py
checkpoints and resumes it), engine.py (the algorithms run at each event), models.py, optim.py,
losses.py, checkpoints.py, state.py and rng.py (exact resume), distributed.py and stop_requests.py
(process groups, preemption, faults), run_log.py (the run directory and progress), step_phases.py
(where a step's time goes).
"""
