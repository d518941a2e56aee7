"""Measure this device's matmul FLOP/s and cache the peak for MFU: `python -m rnnlab.peak_flops`
(rnnlab/peak_flops.py), kept as a script so that existing commands still work."""

if __name__ == "__main__":
    from rnnlab.peak_flops import main

    main()
