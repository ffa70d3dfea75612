"""Checkpoints of a training run: saving and loading (:mod:`.store`), the versioned directories
under a root (:mod:`.dirs`), their integrity manifest (:mod:`.manifest`), reading DCP state
safely (:mod:`.reader`), interrupt-safe saves (:mod:`.save_guard`), the RNG state (:mod:`.rng`),
the run's locked directories (:mod:`.run_dirs`, :mod:`.dir_lock`) and resuming (:mod:`.resume`).

This room imports ``train.config`` and ``train.loop`` (a resume position) from the rest of
``train``, never the engines or the streams.
"""
