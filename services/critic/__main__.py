from services.core.entry import service_main
from services.critic.server import serve

service_main("critic", serve)
