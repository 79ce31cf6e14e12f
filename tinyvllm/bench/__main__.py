from tinyvllm.bench.cli import main

main()
