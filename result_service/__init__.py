"""Result service: relays Redis token streams to clients over WebSocket and SSE, and serves the chat page."""
