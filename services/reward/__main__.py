from services.core.entry import service_main
from services.reward.server import serve

service_main("reward", serve)
