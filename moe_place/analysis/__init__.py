"""moe_place.analysis"""
