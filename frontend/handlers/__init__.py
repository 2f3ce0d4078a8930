"""The handlers of the routes that are no generation API: `OpenAIServer` (server.py) holds
what they share and answers for the server itself; the token routes (tokens.py) and the
engine's control routes (control.py) are its parts. The route table (frontend/routes.py)
names each by its attribute path on `OpenAIServer`."""
