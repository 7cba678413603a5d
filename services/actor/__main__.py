from services.core.serving.entry import service_main
from services.models.engines.boot import start_early

# The server module (torch, transformers, the trainer: ~15 s on a GPU host) is imported after the
# engine's process has started, so that the two start at once.
service_main("actor", "services.actor.server:serve", prestart=start_early)
