"""Every task of a local parameter-server cluster runs this; only the chief gets past
create_strategy. Keras fit must then be refused with a message that points to the loop."""

import tfpar

strategy = tfpar.create_strategy("parameter_server", connect_timeout_s=60)
info = tfpar.describe(strategy)
print(f"describe: {info}", flush=True)

import fit_model  # noqa: E402

try:
    fit_model.train(strategy, fit_model.initial_weights(), steps=1)
    print("PS_FIT: ran", flush=True)
except tfpar.UnsupportedStrategyError as e:
    print(f"PS_FIT: refused: {e}", flush=True)
