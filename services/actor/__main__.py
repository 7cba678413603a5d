from services.actor.server import serve
from services.core.entry import service_main

service_main("actor", serve)
