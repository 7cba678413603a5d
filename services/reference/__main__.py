from services.core.entry import service_main
from services.reference.server import serve

service_main("reference", serve)
