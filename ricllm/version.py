"""ricllm's version, in a module of its own: code that keys caches by it imports this, not the
package root (whose lazy names import the engine, a cycle for any module the engine imports)."""

__version__ = "0.1.0"
