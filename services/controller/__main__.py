from services.controller.server import serve
from services.core.entry import service_main

service_main("controller", serve)
