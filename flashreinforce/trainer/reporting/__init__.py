"""What a run reports: ``metrics.jsonl`` and the progress display, evaluations, samples, trackers.

It owns one update's metrics record (:mod:`.metrics`) and the fault counters in it
(:mod:`.fault_counters`), the names of how a trajectory ended (:mod:`.outcomes`), readable samples
(:mod:`.samples`), TensorBoard and W&B (:mod:`.loggers`), the warning about a run that cannot learn
(:mod:`.diagnostics`), evaluation on held-out prompts (:mod:`.evaluation`, :mod:`.heldout`) and
``summary.json`` (:mod:`.summary`). It reads the rollout side's records and plays evaluation
episodes with its workers; it imports nothing of the learning, persistence or run parts.
"""
