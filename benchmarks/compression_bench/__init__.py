"""Gradient compression on 2 and 4 workers: loss at equal steps, bytes, step time, time to quality.

Run through benchmarks/compression.py (its docstring has the commands). The parts:

    configs.py   the configurations (name -> the binary's --config.compression* flags and the
                 optimizer the binary gives it), their compressions and the policies' plans
    suites.py    sittings: the command line's links x workers, or a named suite (time_to_quality)
    worker.py    one worker process: trains every configuration in turn, measures each
    cluster.py   starts the workers on loopback or in shaped namespaces, collects worker 0's
    links.py     the shaped links (network namespaces, a bridge, tc netem + tbf; root)
    goals.py     rows, time to quality and the goals (ratio, loss gap, speed, scaling)
    plots.py     the printed table and the plot
    cli.py       the command line and the JSON

Links named by a rate (e.g. 100mbit, 1gbit): N network namespaces (one per worker) joined
by veth pairs to a bridge in its own namespace; every worker end carries `netem delay 1ms`
with a `tbf rate RATE` child (tbf alone where the kernel has no sch_netem). Per
configuration and link: validation loss against wall-clock seconds of training (time to
quality; evaluation excluded), the time to reach the uncompressed run's final validation
loss, bytes per worker per step (handed to collectives, and transmitted on the link:
tfpar.compression.accounting.link_bytes_per_worker), compute time of one step (forward +
backward alone) vs the rest (collectives), and the achieved link bandwidth.

--model: gpt_tiny (configs/gpt_tiny.py: 2 blocks of 128, 128-byte windows) or gpt_wide
(384 wide, 64-byte windows: the gradient, not the compute, is the cost; use --batch=8).
Every configuration trains with the optimizer its config file names (AdamW, 60 warm-up
steps, cosine decay over the run, weight decay 0.01, beta_2 0.98, clip_norm 1.0), as the
binary gives it: onebit_adam and dgc_adam take that AdamW; dgc and none(sgd) train with
`--config.optimizer.name=sgd --config.optimizer.learning_rate=0.1` (configs.py). Global
batch --batch over the workers under multi_worker_mirrored (one CPU replica each), the same
seed and data order for every configuration.

Per configuration: bytes one replica hands to collectives per step and the ratio to one
float32 all-reduce (Trainer.wire_bytes, counted from the traced step of the last phase),
"run_ratio": the same ratio averaged over the whole run (analytic bytes of every phase),
the validation loss on a fixed subset (the first --eval-examples validation windows) every
--eval-every steps, the step time (median over the tf.function calls of --steps-per-loop
steps after the first --warmup-calls, evaluation excluded), the optimizer config and the
binary's flags. Speed lives here, never in tests.
"""
