from services.core.serving.entry import service_main

# Named, not imported: the server module loads after the launcher's watch is set up and the config is
# checked (services.core.serving.entry).
service_main("reference", "services.reference.server:serve")
